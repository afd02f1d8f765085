"""The room a bank has under vLLM 0.34's extensible KV cache
(``connector/bank_fit.py``'s docstring has the timeline, with vLLM's lines):
the cache is sized after warmup by ``measure_kv_cache_bytes`` and the
connector registers only after it is committed, so a bank may take what is
free less what vLLM keeps - its transient peak and its margin - and the
utilization a refusal names is the largest that leaves it that room.

vLLM 0.34 is modelled here as ``gpu_worker.py`` and ``extensible_kv_cache.py``
run it (``vllm_034_start``); ``bank_fit.measure_kv_cache_bytes`` is checked
against numbers worked by hand from 0.34's code and, where the installed vLLM
has it (``make test-vllm034``), against vLLM's own function.
"""
import math

import numpy as np
import pytest

from kvfill.check.device_memory import PEAK_ALLOWANCE, SERVER_CONTEXT_BYTES, measured_peak, plan_room
from kvfill.connector.bank_fit import (EXTENSIBLE_MARGIN_FLOOR, NON_TORCH_RESERVE, allocatable, bank_room,
                                       choose_placement, extensible_margin, extensible_peak, fit_error, kept_free,
                                       measure_kv_cache_bytes, utilization_for)

GIB = 2**30
MIB = 2**20
H200 = 143_771 * MIB  # what torch reports for an H200's memory
BLOCK = 2 * MIB       # bytes per KV cache block, all layers (vLLM commits whole blocks)


def vllm_034_start(*, total=H200, baseline=3 * GIB // 2, utilization=1.0, weights=16 * GIB, graphs=2 * GIB,
                   peak=4 * GIB, growth=0, non_torch=0):
    """vLLM 0.34 on CUDA with its extensible KV cache, up to the connector's
    ``register_kv_caches``: the start-up snapshot (``init_free``,
    ``requested``; gpu_worker.py:549-551), warmup with weights and graphs
    held by torch, ``non_torch`` bytes allocated outside it since the
    snapshot and the null block committed; the measure after capture
    (extensible_kv_cache.py:637-692: whole blocks, torch capped at what it
    holds plus what stays free less 512 MiB); the commit (``:530``).
    ``(gpu, vllm)``: what the connector sees, as ``load_bank`` passes it to
    ``fit_error``, and vLLM's own figures."""
    init_free = total - baseline
    requested = math.ceil(total * utilization)
    reserved, committed = weights + graphs, BLOCK
    free_measured = init_free - reserved - non_torch - committed
    available = measure_kv_cache_bytes(init_free_memory=init_free, free_memory=free_measured,
                                       committed_bytes=committed, requested_memory=requested,
                                       transient_peak_bytes=peak, torch_reserve_growth_bytes=growth)
    kv = available // BLOCK * BLOCK
    free = free_measured - (kv - committed)
    cap = reserved + max(free - NON_TORCH_RESERVE, 0)
    gpu = dict(free=free, total=total, held=reserved + kv, torch_free=allocatable(free, total, reserved, cap / total),
               utilization=utilization, kv_cache_memory_bytes=None, extensible=True)
    return gpu, dict(init_free=init_free, kv=kv, cap=cap, reserved=reserved, peak=peak, growth=growth)


def largest_accepted(gpu):
    lo, hi = 0, gpu["free"] + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fit_error(mid, **gpu) is None else (lo, mid)
    return lo


def leaves_vllm_its_keep(nbytes, gpu, vllm):
    """A bank of ``nbytes`` leaves vLLM what its sizing kept: its peak (or
    torch's growth) in full and its margin free, and torch room to grow by it."""
    return (gpu["free"] - nbytes >= kept_free(vllm["peak"], vllm["growth"])
            and vllm["cap"] - vllm["reserved"] - nbytes >= max(vllm["peak"], vllm["growth"]))


def suggested(line):
    return float(line.split("--gpu-memory-utilization ")[2].split(" ")[0])


# ------------------------------------------------------------ vLLM's sizing, modelled
def test_measure_kv_cache_bytes_matches_hand_worked_numbers_from_vllm_034():
    """extensible_kv_cache.py:613-618 by hand.  Bound by the device: init
    free 100, free 70, committed 2 (non-KV 28), requested 140 (utilization
    1.0 of 140), peak 4 (margin max(1, 3) = 3): min(112, 72 - 3) - 4 = 65.
    Bound by the budget at 0.8 (112): min(84, 69) - 4 = ... 69 still; at 0.6
    (84): min(56, 69) - 4 = 52.  Growth 5 above the peak: kept in full (64),
    the margin stays the peak's.  Nothing left: 0."""
    common = dict(init_free_memory=100 * GIB, free_memory=70 * GIB, committed_bytes=2 * GIB,
                  transient_peak_bytes=4 * GIB)
    assert measure_kv_cache_bytes(requested_memory=140 * GIB, **common) == 65 * GIB
    assert measure_kv_cache_bytes(requested_memory=112 * GIB, **common) == 65 * GIB
    assert measure_kv_cache_bytes(requested_memory=84 * GIB, **common) == 52 * GIB
    assert measure_kv_cache_bytes(requested_memory=140 * GIB, torch_reserve_growth_bytes=5 * GIB, **common) == 64 * GIB
    assert measure_kv_cache_bytes(requested_memory=20 * GIB, **common) == 0
    # a peak under 4/3 GiB: the 1 GiB floor is the margin
    assert measure_kv_cache_bytes(requested_memory=140 * GIB, **{**common, "transient_peak_bytes": GIB}) == 70 * GIB


def test_measure_kv_cache_bytes_is_vllms_own_where_this_vllm_has_it():
    ext = pytest.importorskip("vllm.v1.worker.extensible_kv_cache",
                              reason="vLLM 0.34's extensible KV cache is not in this vLLM (make test-vllm034)")
    assert (ext.KV_CACHE_MARGIN_FLOOR_BYTES, ext.KV_CACHE_MARGIN_FRACTION, ext.KV_CACHE_NON_TORCH_RESERVE_BYTES) \
        == (EXTENSIBLE_MARGIN_FLOOR, 0.75, NON_TORCH_RESERVE)
    rng = np.random.default_rng(3)
    for _ in range(500):
        init_free = int(rng.integers(10, 140)) * GIB + int(rng.integers(0, GIB))
        free = int(rng.integers(0, init_free))
        kw = dict(init_free_memory=init_free, free_memory=free, committed_bytes=int(rng.integers(0, 4 * GIB)),
                  requested_memory=int(rng.integers(1, 150 * GIB)), transient_peak_bytes=int(rng.integers(0, 8 * GIB)),
                  torch_reserve_growth_bytes=int(rng.integers(0, 8 * GIB)))
        assert measure_kv_cache_bytes(**kw) == ext.measure_kv_cache_bytes(**kw), kw


# ------------------------------------------------------------ the room at registration
@pytest.mark.parametrize("utilization", [0.8, 0.9, 0.95, 1.0])
@pytest.mark.parametrize("peak, growth, non_torch", [(4 * GIB, 0, 0), (GIB // 2, 0, 0), (2 * GIB, 3 * GIB, 0),
                                                     (4 * GIB, 0, GIB // 2)])
def test_the_largest_bank_accepted_leaves_vllm_its_peak_and_margin_and_no_more_where_it_measured_them_alone(
        utilization, peak, growth, non_torch):
    gpu, vllm = vllm_034_start(utilization=utilization, peak=peak, growth=growth, non_torch=non_torch)
    largest = largest_accepted(gpu)
    assert leaves_vllm_its_keep(largest, gpu, vllm)
    slack = vllm["init_free"] - math.ceil(H200 * utilization)
    exact = max(0, slack - extensible_margin(peak))  # the budget's slack less the margin: all the room there is
    if non_torch == 0 and growth <= peak:
        assert exact - BLOCK <= largest <= exact + BLOCK, (largest / GIB, exact / GIB)
    else:  # what vLLM allocated outside torch, and torch's growth past the peak, counted against the bank
        assert largest <= exact + BLOCK
        assert largest >= exact - 2 * (non_torch + growth)


def test_at_vllms_default_utilization_the_cache_leaves_a_bank_no_room():
    """Unset, --gpu-memory-utilization resolves to 1.0 (config/cache.py:499):
    the device bounds the cache, whose rounding to whole blocks is all that is
    left beside vLLM's peak and margin."""
    gpu, vllm = vllm_034_start()
    assert gpu["free"] >= kept_free(4 * GIB)
    assert largest_accepted(gpu) <= BLOCK
    room, peak, kept = bank_room(**{k: gpu[k] for k in ("free", "total", "utilization", "held", "torch_free")},
                                 extensible=True)
    assert peak == 4 * GIB - 0 or abs(peak - 4 * GIB) < BLOCK and kept == extensible_margin(peak)


def test_the_peak_taken_is_never_below_the_one_vllm_measured():
    rng = np.random.default_rng(11)
    for _ in range(200):
        u = float(rng.choice([0.7, 0.85, 0.9, 0.95, 1.0]))
        peak, growth = int(rng.integers(0, 10 * GIB)), int(rng.integers(0, 10 * GIB))
        gpu, vllm = vllm_034_start(utilization=u, peak=peak, growth=growth, non_torch=int(rng.integers(0, GIB)),
                                   weights=int(rng.integers(1, 60)) * GIB)
        still = math.ceil(H200 * u) - gpu["held"]
        assert extensible_peak(gpu["free"], still) >= peak
        assert leaves_vllm_its_keep(largest_accepted(gpu), gpu, vllm)


# ------------------------------------------------------------ the utilization named
@pytest.mark.parametrize("nbytes, fits, old", [(256 * MIB, 0.965, 0.94), (int(9.25 * GIB), 0.90, 0.87)])
def test_the_utilization_named_fits_by_vllms_own_sizing_and_cuts_little_more_than_that(nbytes, fits, old):
    """The review's figures (an H200, 1.5 GiB baseline, 18 GiB of weights and
    graphs, a 4 GiB peak): 256 MiB of staging, and a 9.25 GiB part, where
    0.965 and 0.90 fit and kvfill named 0.94 and 0.87.  The named value,
    started again, fits by vLLM's own measure; it is at most 0.011 below the
    largest that does (the margin of a peak up to all that is free less
    1 GiB: the connector cannot tell the peak from torch's growth)."""
    gpu, _ = vllm_034_start()
    lower = suggested(fit_error(nbytes, **gpu))
    again, vllm = vllm_034_start(utilization=lower)
    assert fit_error(nbytes, **again) is None
    assert leaves_vllm_its_keep(nbytes, again, vllm)
    largest = max(u / 1000 for u in range(500, 1001)
                  if leaves_vllm_its_keep(nbytes, *vllm_034_start(utilization=u / 1000)))
    assert largest >= fits and old < lower <= largest and largest - lower <= 0.0115, (lower, largest)


def test_the_utilization_named_fits_whenever_one_does():
    """Random starts where vLLM allocates nothing outside torch after its
    snapshot (what it does allocate there counts against the bank 1.75 times
    over at registration, unseen by the refusal that named the value)."""
    rng = np.random.default_rng(5)
    checked = 0
    for _ in range(300):
        start = dict(utilization=float(rng.choice([0.9, 0.95, 1.0])), peak=int(rng.integers(0, 8 * GIB)),
                     growth=int(rng.integers(0, 6 * GIB)),
                     weights=int(rng.integers(1, 60)) * GIB, baseline=int(rng.integers(0, 10 * GIB)))
        gpu, _ = vllm_034_start(**start)
        nbytes = int(rng.integers(1, 40 * GIB))
        line = fit_error(nbytes, **gpu)
        if line is None or "--gpu-memory-utilization 0" not in line.split("Make room")[1]:
            continue
        lower = suggested(line)
        again, vllm = vllm_034_start(**{**start, "utilization": lower})
        assert fit_error(nbytes, **again) is None, (start, nbytes, lower)
        assert leaves_vllm_its_keep(nbytes, again, vllm)
        checked += 1
    assert checked > 100


def test_utilization_for_is_on_the_grid_and_none_where_nothing_fits():
    assert utilization_for(GIB, init_free=100 * GIB, total=100 * GIB, peak=0) == 0.98
    assert utilization_for(200 * GIB, init_free=100 * GIB, total=100 * GIB, peak=0) is None
    u = utilization_for(256 * MIB, init_free=H200 - 3 * GIB // 2, total=H200, peak=4 * GIB)
    assert u == round(u, 3) and math.ceil(H200 * u) <= H200 - 3 * GIB // 2 - 3 * GIB - 256 * MIB


# ------------------------------------------------------------ rotary tables (past_bank "rotate")
def test_rotary_tables_count_on_the_gpu_in_either_placement_and_are_named():
    gpu = dict(free=20 * GIB, total=80 * GIB, held=58 * GIB, utilization=0.9, kv_cache_memory_bytes=None)
    room = 20 * GIB - (math.ceil(80 * GIB * 0.9) - 58 * GIB) - (150 * MIB)
    rows, staging, tables = room - 200 * MIB, 256 * MIB, 64 * MIB
    where, line = choose_placement("auto", rows=rows, states=0, staging=staging, rotate=True, **gpu)
    assert where == "host"  # rows + staging already past the room
    where, line = choose_placement("auto", rows=rows - 100 * MIB, states=0, staging=staging, rotate=True, **gpu)
    assert where == "device" and "256 MiB of staging" in line
    where, line = choose_placement("auto", rows=rows - 100 * MIB, states=0, staging=staging, rotate=True,
                                   tables=tables, **gpu)
    assert where == "host" and "64 MiB of rotary tables" in line, line
    where, line = choose_placement("host", rows=rows, states=room - staging - tables + 1, staging=staging, rotate=True,
                                   tables=tables, **gpu)
    assert where is None and "64 MiB of rotary tables" in line, line
    where, _ = choose_placement("host", rows=rows, states=room - staging - tables, staging=staging, rotate=True,
                                tables=tables, **gpu)
    assert where == "host"


# ------------------------------------------------------------ before the engine starts (device_memory)
def test_the_utilization_passed_before_start_leaves_the_bank_room_when_vllm_then_sizes_its_cache():
    """plan_room from the GPU's free memory before the server (its context
    then takes SERVER_CONTEXT_BYTES) and a measured peak: the engine started
    with it accepts the bank at registration."""
    baseline = SERVER_CONTEXT_BYTES
    for rows, placement in [(9 * GIB, "device"), (9 * GIB, "auto"), (90 * GIB, "auto"), (2 * GIB, "host")]:
        plan = plan_room(placement, rows=rows, states=GIB // 4, staging=256 * MIB, tables=64 * MIB, rotate=True,
                         free=H200, total=H200, asked=None, peak=4 * GIB)
        assert not plan.refused and plan.utilization, plan
        gpu, _ = vllm_034_start(utilization=plan.utilization, baseline=baseline)
        where, line = choose_placement(placement, rows=rows, states=GIB // 4, staging=256 * MIB, rotate=True,
                                       tables=64 * MIB, **gpu)
        assert where == ("host" if rows == 90 * GIB or placement == "host" else "device"), line


def test_before_start_a_utilization_that_leaves_no_room_is_refused_naming_one_that_does():
    plan = plan_room("device", rows=20 * GIB, states=0, staging=256 * MIB, tables=0, rotate=False, free=H200,
                     total=H200, asked=0.95, peak=None)
    assert plan.refused and plan.utilization is None
    named = float(plan.line.split("pass --gpu-memory-utilization ")[1].split(" ")[0])
    assert f"transient peak of {PEAK_ALLOWANCE / GIB:.2f} GiB (assumed)" in plan.line
    gpu, _ = vllm_034_start(utilization=named, baseline=SERVER_CONTEXT_BYTES, peak=PEAK_ALLOWANCE)
    assert fit_error(20 * GIB, **gpu) is None
    ok = plan_room("device", rows=20 * GIB, states=0, staging=256 * MIB, tables=0, rotate=False, free=H200,
                   total=H200, asked=named, peak=None)
    assert not ok.refused and ok.utilization is None  # the user's own value stands
    nowhere = plan_room("host", rows=GIB, states=200 * GIB, staging=256 * MIB, tables=0, rotate=False, free=H200,
                        total=H200, asked=None, peak=None)
    assert nowhere.refused and "no --gpu-memory-utilization leaves room" in nowhere.line


def test_the_peak_is_read_from_vllms_memory_after_warmup_line():
    line = ("INFO 05-01 12:00:00 [extensible_kv_cache.py:693] Memory after warmup: 120.5 GiB free, 0.0 GiB committed "
            "to the KV cache, 4.2 GiB kept for transient activations (3.9 GiB allocated at peak, 4.2 GiB of torch "
            "reservation growth); 1000 KV cache blocks (100.0 GiB) fit within the requested 140.4 GiB. Torch may "
            "reserve up to 30.0 GiB.")
    assert measured_peak("noise\n" + line) == math.ceil(4.21 * GIB)  # the figure kept: torch's growth, here
    assert measured_peak("no such line") is None
