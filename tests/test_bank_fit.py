"""Whether a rank's bank part fits its GPU (``connector/bank_fit.py``),
checked against vLLM's own memory budget, modelled here as vLLM 0.32 does it
(``vllm/v1/worker/gpu_worker.py``):

* ``request_memory``: at start-up, after the CUDA context, NCCL and any other
  process took what they take (the *baseline*), vLLM requests
  ``ceil(total x utilization)``;
* ``determine_available_memory``: its KV cache is that budget less the
  weights, the forward's peak activations and the CUDA graphs' estimate
  (or ``--kv-cache-memory-bytes`` exactly);
* after ``register_kv_caches`` it still allocates the activations and graphs.

A bank accepted must leave that, plus vLLM's 150 MiB margin, free.
"""
import math
import re

import numpy as np
import pytest

from kvfill.connector.bank_fit import MARGIN_BYTES, allocatable, choose_placement, fit_error

GIB = 2**30
H200 = 143_771 * 2**20  # what torch reports for an H200's memory


def vllm_after_register(*, total, baseline, utilization, weights, activations, graphs, kv_cache_memory_bytes=None):
    """The GPU as the connector sees it in ``register_kv_caches`` and what vLLM
    allocates after it: ``(dict(free, total, held), still_needed)``."""
    requested = math.ceil(total * utilization)
    assert total - baseline >= requested or kv_cache_memory_bytes, "vLLM itself refuses to start"
    kv = kv_cache_memory_bytes or requested - weights - activations - graphs
    held = weights + kv
    return dict(free=total - baseline - held, total=total, held=held), activations + graphs


def largest_accepted(gpu, utilization, kv_cache_memory_bytes=None, extensible=False):
    """The largest bank fit_error accepts (bisection over bytes)."""
    lo, hi = 0, gpu["free"] + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok = fit_error(mid, utilization=utilization, kv_cache_memory_bytes=kv_cache_memory_bytes,
                       extensible=extensible, **gpu) is None
        lo, hi = (mid, hi) if ok else (lo, mid)
    return lo


# name, vLLM's start (total, baseline, utilization, weights, activations, graphs[, kv bytes])
CASES = [
    ("dedicated H200, 1.5 GiB baseline", dict(total=H200, baseline=3 * GIB // 2, utilization=0.9, weights=16 * GIB,
                                              activations=4 * GIB, graphs=2 * GIB)),
    ("dedicated H200, no baseline", dict(total=H200, baseline=0, utilization=0.9, weights=16 * GIB,
                                         activations=4 * GIB, graphs=2 * GIB)),
    ("second of two instances at 0.45", dict(total=H200, baseline=3 * GIB // 2 + math.ceil(H200 * 0.45),
                                             utilization=0.45, weights=16 * GIB, activations=4 * GIB,
                                             graphs=2 * GIB)),
    ("80 GiB GPU, 8 GiB taken by another process", dict(total=80 * GIB, baseline=8 * GIB, utilization=0.85,
                                                        weights=40 * GIB, activations=3 * GIB, graphs=GIB)),
    ("--kv-cache-memory-bytes inside the budget", dict(total=H200, baseline=3 * GIB // 2, utilization=0.9,
                                                       weights=16 * GIB, activations=4 * GIB, graphs=2 * GIB,
                                                       kv_cache_memory_bytes=60 * GIB)),
]


@pytest.mark.parametrize("name, start", CASES, ids=[c[0] for c in CASES])
def test_the_largest_bank_accepted_leaves_vllm_what_it_still_allocates_and_its_margin(name, start):
    gpu, still = vllm_after_register(**start)
    u, kvb = start["utilization"], start.get("kv_cache_memory_bytes")
    largest = largest_accepted(gpu, u, kvb)
    left = gpu["free"] - largest
    assert left >= still + MARGIN_BYTES, (name, left, still)
    if kvb is None:  # not more than that kept: vLLM sized its KV cache to use its budget whole
        assert left == still + MARGIN_BYTES, (name, left / GIB, still / GIB)
    else:  # a KV cache smaller than the budget allows: the budget's rest is kept (vLLM's to use)
        assert left == math.ceil(gpu["total"] * u) - gpu["held"] + MARGIN_BYTES
    assert fit_error(largest + 1, utilization=u, kv_cache_memory_bytes=kvb, **gpu) is not None


def test_a_bank_the_room_of_utilization_x_total_less_used_would_take_is_refused():
    """The issue's figures: a dedicated H200 with a 1.5 GiB baseline. ``u x
    total - used`` counts the baseline as vLLM's and keeps 1.5 GiB too little;
    a bank that size is refused now, naming what is kept and why."""
    start = CASES[0][1]
    gpu, still = vllm_after_register(**start)
    used = gpu["total"] - gpu["free"]
    naive_room = gpu["free"] - max(0, int(0.9 * gpu["total"]) - used)
    line = fit_error(naive_room, utilization=0.9, kv_cache_memory_bytes=None, **gpu)
    assert line is not None
    assert f"{still / GIB:.2f} GiB of them kept for what vLLM allocates after registering its caches" in line, line
    assert "150 MiB of margin" in line


def test_with_kv_cache_memory_bytes_past_the_budget_only_the_margin_is_kept_and_a_smaller_kv_cache_named():
    """``--kv-cache-memory-bytes`` larger than vLLM's budget allows: vLLM has
    no budget left for its graphs and activations (its own warning says it
    may run out of memory); kvfill keeps the margin and names a KV cache
    smaller by the shortfall."""
    kv_bytes = 50 * GIB
    gpu = dict(free=4 * GIB, total=80 * GIB, held=76 * GIB)  # held past 0.9 x 80 = 72
    line = fit_error(6 * GIB, utilization=0.9, kv_cache_memory_bytes=kv_bytes, **gpu)
    assert "0.00 GiB of them kept" in line, line
    short = 6 * GIB - (4 * GIB - MARGIN_BYTES)
    assert f"Make room for {short / GIB:.2f} GiB more: --kv-cache-memory-bytes {kv_bytes - short} or lower; or " \
        "record fewer" in line, line
    # vLLM's KV cache that much smaller: that much more free, that much less held
    assert fit_error(6 * GIB, utilization=0.9, kv_cache_memory_bytes=kv_bytes - short,
                     free=gpu["free"] + short, total=gpu["total"], held=gpu["held"] - short) is None


def test_with_vllms_budget_not_used_up_a_smaller_kv_cache_is_not_suggested():
    """12 of the 20 free GiB are vLLM's: a KV cache smaller by the shortfall
    would only grow what it still needs (free and kept rise together), so
    only a lower utilization is offered."""
    line = fit_error(10 * GIB, free=20 * GIB, total=80 * GIB, utilization=0.9, held=60 * GIB,
                     kv_cache_memory_bytes=50 * GIB)
    assert "--gpu-memory-utilization 0.87 or lower" in line and "--kv-cache-memory-bytes" not in line, line


def with_smaller_kv_cache(nbytes, gpu, utilization, lower):
    """fit_error after vLLM's KV cache shrinks by what utilization ``lower``
    gives up: that much more free and that much less held."""
    shrink = math.ceil(utilization * gpu["total"]) - math.ceil(lower * gpu["total"])
    return fit_error(nbytes, free=gpu["free"] + shrink, total=gpu["total"], held=gpu["held"] - shrink,
                     utilization=lower, kv_cache_memory_bytes=None)


def suggested_utilization(line):
    return float(line.split("--gpu-memory-utilization ")[2].split(" ")[0])


def test_a_bank_that_does_not_fit_names_its_bytes_what_is_kept_and_a_utilization_that_fits():
    gpu = dict(free=20 * GIB, total=80 * GIB, held=60 * GIB)  # vLLM's budget 72: 12 still to allocate
    line = fit_error(10 * GIB, utilization=0.9, kv_cache_memory_bytes=None, **gpu)
    assert line.startswith("this rank's part of the bank takes 10.00 GiB; the GPU has 20.00 GiB free, 12.00 GiB of "
                           "them kept for what vLLM allocates after registering its caches"), line
    assert "less the 60.00 GiB it holds) and 150 MiB of margin, leaving 7.85 GiB. Make room for 2.15 GiB more: " \
           "--gpu-memory-utilization 0.87 or lower" in line, line
    assert with_smaller_kv_cache(10 * GIB, gpu, 0.9, 0.87) is None
    assert with_smaller_kv_cache(10 * GIB, gpu, 0.9, 0.88) is not None  # 0.87 is the largest


def test_the_suggested_utilization_fits_whenever_one_does():
    """Seeded random GPUs (vLLM started over a random baseline) and banks
    that a utilization of 0.01 or more makes room for: the suggested value,
    plugged back in with the KV cache that much smaller, fits."""
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(300):
        u = float(rng.choice([0.5, 0.8, 0.85, 0.9, 0.92, 0.95]))
        total = 80 * GIB
        baseline = int(rng.integers(0, int((1 - u) * total)))
        gpu, _ = vllm_after_register(total=total, baseline=baseline, utilization=u, weights=int(rng.integers(1, 30)) * GIB,
                                     activations=int(rng.integers(1, 8)) * GIB, graphs=GIB)
        nbytes = int(rng.integers(1, 40 * GIB))
        line = fit_error(nbytes, utilization=u, kv_cache_memory_bytes=None, **gpu)
        if line is None:
            continue
        short = float(re.search(r"Make room for ([0-9.]+) GiB more", line).group(1)) * GIB
        if short > (u - 0.01) * total or "--gpu-memory-utilization" not in line.split("Make room")[1]:
            continue
        lower = suggested_utilization(line)
        assert 0 < lower < u, (nbytes, gpu, u, line)
        assert with_smaller_kv_cache(nbytes, gpu, u, lower) is None, (nbytes, gpu, u, lower)
        checked += 1
    assert checked > 50


def test_a_bank_no_utilization_makes_room_for_is_not_given_a_utilization_of_zero_or_less():
    """A part larger than the whole GPU: no --gpu-memory-utilization fits it."""
    line = fit_error(100 * GIB, free=20 * GIB, total=80 * GIB, utilization=0.9, held=60 * GIB,
                     kv_cache_memory_bytes=None)
    assert line is not None and "takes 100.00 GiB" in line
    suggested = re.findall(r"--gpu-memory-utilization (-?[0-9.]+) or lower", line)
    assert not suggested or float(suggested[0]) > 0, line


@pytest.mark.parametrize("nbytes, free, total, utilization, held", [
    (7 * GIB, 20 * GIB, 80 * GIB, 0.9, 60 * GIB),  # 12 kept + margin, 7.85 left
    (1, GIB, 10 * GIB, 0.5, 5 * GIB),              # budget used up: the margin only
    (5 * GIB, 6 * GIB, 10 * GIB, 0.1, 4 * GIB),    # held past the budget
])
def test_a_bank_that_fits_beside_vllms_budget_is_no_error(nbytes, free, total, utilization, held):
    assert fit_error(nbytes, free=free, total=total, utilization=utilization, held=held,
                     kv_cache_memory_bytes=None) is None


# ------------------------------------------------------------ where the bank is kept (choose_placement)
def _placed(asked, rows, states=0, staging=256 << 20, gpu=None):
    gpu = gpu or dict(free=20 * GIB, total=80 * GIB, held=58 * GIB)  # 14 GiB kept for vLLM: ~5.85 GiB of room
    return choose_placement(asked, rows=rows, states=states, staging=staging, utilization=0.9,
                            kv_cache_memory_bytes=None, **gpu)


def test_auto_keeps_a_bank_that_fits_on_the_gpu_and_one_that_does_not_in_host_memory_saying_why():
    gpu = dict(free=20 * GIB, total=80 * GIB, held=58 * GIB)
    room = 20 * GIB - (math.ceil(80 * GIB * 0.9) - 58 * GIB) - MARGIN_BYTES
    where, line = _placed("auto", room - GIB, GIB)
    assert where == "device" and "on the GPU, read in place" in line, line
    where, line = _placed("auto", room - GIB + 1, GIB)
    assert where == "host", line
    assert f"the part's {(room + 1) / GIB:.2f} GiB exceed the {room / GIB:.2f} GiB the GPU has beside vLLM's " \
           f"budget" in line and "streamed to the GPU through 256 MiB of staging" in line, line
    assert fit_error(room, utilization=0.9, kv_cache_memory_bytes=None, **gpu) is None  # the same room as fit_error


def test_host_placement_needs_room_for_the_states_and_the_staging_only():
    where, line = _placed("host", rows=500 * GIB, states=GIB)
    assert where == "host" and "- asked" in line, line
    where, line = _placed("host", rows=GIB, states=5 * GIB, staging=GIB)  # 6 GiB of the ~5.85 free: nowhere
    assert where is None and "even kept in host memory (bank_placement 'host')" in line, line
    assert "(5.00 + 1.00 GiB) do not fit" in line, line


def test_device_placement_refuses_a_bank_that_does_not_fit_naming_host_placement():
    where, line = _placed("device", rows=10 * GIB)
    assert where is None and line.endswith("or bank_placement 'host' (the rows in host memory, streamed per step)")
    assert "this rank's part of the bank takes 10.00 GiB" in line, line


def test_re_rotating_a_device_resident_bank_counts_its_staging_and_auto_keeps_it_on_the_host_when_that_does_not_fit():
    """past_bank 'rotate' gathers a device-resident bank's turned rows into a
    staging on the GPU: a part that fits alone but not with the staging is
    kept on the host by auto (where only the staging goes) and refused by
    device, naming the way out."""
    room = 20 * GIB - (math.ceil(80 * GIB * 0.9) - 58 * GIB) - MARGIN_BYTES
    rows = room - (128 << 20)  # fits alone; not with 256 MiB of staging
    assert _placed("auto", rows)[0] == "device"
    where, line = choose_placement("auto", rows=rows, states=0, staging=256 << 20, utilization=0.9,
                                   kv_cache_memory_bytes=None, free=20 * GIB, total=80 * GIB, held=58 * GIB,
                                   rotate=True)
    assert where == "host" and f"the part's {(rows + (256 << 20)) / GIB:.2f} GiB exceed" in line, line
    where, line = choose_placement("device", rows=rows, states=0, staging=256 << 20, utilization=0.9,
                                   kv_cache_memory_bytes=None, free=20 * GIB, total=80 * GIB, held=58 * GIB,
                                   rotate=True)
    assert where is None and "bank_placement 'host'" in line, line
    where, line = choose_placement("auto", rows=GIB, states=0, staging=256 << 20, utilization=0.9,
                                   kv_cache_memory_bytes=None, free=20 * GIB, total=80 * GIB, held=58 * GIB,
                                   rotate=True)
    assert where == "device" and "with 256 MiB of staging for keys re-rotated" in line, line


# ------------------------------------------------------------ vLLM 0.34's extensible KV cache
NON_TORCH = 1 << 29  # extensible_kv_cache.py: KV_CACHE_NON_TORCH_RESERVE_BYTES on CUDA


def vllm_034_extensible(*, total, baseline, utilization, weights, activations, graphs):
    """The GPU as the connector sees it under vLLM 0.34's extensible KV cache
    (CUDA's default), modelled as ``extensible_kv_cache.measure_kv_cache_bytes``
    sizes it: after warmup (weights and CUDA graphs in torch's allocator) the
    cache takes its budget less what vLLM uses, capped by the device less a
    margin, less the transient peak it keeps free; torch is capped at what it
    holds plus what stays free less 512 MiB; only then is the connector
    created.  ``(gpu, free, kv, torch_cap, peak, vllm_margin)``: ``gpu`` as
    ``load_bank`` sees it, ``held`` torch's bytes plus the cache mapped
    outside torch, ``torch_free`` what torch can still take."""
    init_free = total - baseline
    non_kv = weights + graphs
    vllm_margin = max(GIB, int(activations * 0.75))
    kv = max(0, min(math.ceil(total * utilization) - non_kv, init_free - non_kv - vllm_margin) - activations)
    free = init_free - non_kv - kv
    cap = non_kv + free - NON_TORCH
    gpu = dict(free=free, torch_free=allocatable(free, total, non_kv, cap / total), total=total, held=non_kv + kv)
    return gpu, free, kv, cap, activations, vllm_margin


EXTENSIBLE = dict(total=H200, baseline=3 * GIB // 2, weights=16 * GIB, activations=4 * GIB, graphs=2 * GIB)


@pytest.mark.parametrize("utilization", [0.8, 0.9, 0.95])
def test_under_the_extensible_kv_cache_a_bank_leaves_vllm_its_peak_its_margin_and_torchs_room(utilization):
    """What a bank takes leaves vLLM what it keeps free for itself - its
    transient peak and its margin - and torch, capped by vLLM, room to grow
    by the peak; below utilization 1.0 the bank gets the budget's slack less
    that margin."""
    gpu, free, _, cap, peak, vllm_margin = vllm_034_extensible(utilization=utilization, **EXTENSIBLE)
    largest = largest_accepted(gpu, utilization, extensible=True)
    assert free - largest >= peak + vllm_margin
    assert cap - (EXTENSIBLE["weights"] + EXTENSIBLE["graphs"]) - largest >= peak
    slack = H200 - EXTENSIBLE["baseline"] - math.ceil(H200 * utilization)
    assert largest == max(0, slack - vllm_margin)


def test_under_the_extensible_kv_cache_at_vllms_default_utilization_no_bank_fits_and_the_way_out_makes_room():
    """vLLM 0.34 resolves an unset --gpu-memory-utilization to 1.0 under the
    extensible KV cache: the cache takes the whole GPU but its transient peak
    and margin, so no byte of a bank fits; the utilization the refusal names
    leaves a KV cache small enough for it."""
    gpu, _, kv, _, _, _ = vllm_034_extensible(utilization=1.0, **EXTENSIBLE)
    assert largest_accepted(gpu, 1.0, extensible=True) == 0
    bank = 20 * GIB
    line = fit_error(bank, utilization=1.0, kv_cache_memory_bytes=None, extensible=True, **gpu)
    lower = float(re.search(r"--gpu-memory-utilization (0\.\d+) or lower", line).group(1))
    gpu, free, smaller, _, peak, vllm_margin = vllm_034_extensible(utilization=lower, **EXTENSIBLE)
    assert fit_error(bank, utilization=lower, kv_cache_memory_bytes=None, extensible=True, **gpu) is None
    # a KV cache smaller by the bank, vLLM's margin and the suggestion's rounding to 0.01, no more
    assert free - bank >= peak + vllm_margin and kv - smaller < bank + vllm_margin + H200 // 100 + GIB
