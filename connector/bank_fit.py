"""Whether a rank's part of a bank fits its GPU beside what vLLM still
allocates, by vLLM's own memory budget.  Plain arithmetic, no vLLM import:
the device image (no vLLM) tests it too, and so do the pre-start checks of
kvfill-check and the serving benchmarks (``check/device_memory.py``).

vLLM 0.32 (and 0.34 with ``--no-enable-extensible-kv-cache``) sizes its KV
cache from a profiling estimate (``gpu_worker.py``: ``request_memory``,
``determine_available_memory``) before the connector registers: what it
still allocates afterwards is its budget ``ceil(total x utilization)`` less
what it holds (``vllm_still_needs``), and it keeps 150 MiB of margin.

vLLM 0.34's extensible KV cache (CUDA's default; ``vllm/v1/worker/``,
line numbers of 0.34.0) sizes it from memory measured after warmup, and
the connector exists only afterwards:

* ``gpu_worker.py:549-551``: ``init_snapshot`` (free memory after the CUDA
  context, NCCL, cuBLAS handles and other processes) and ``requested_memory
  = ceil(total x resolved utilization)`` (``utils.py:742-743``); an unset
  ``--gpu-memory-utilization`` resolves to 1.0 (``config/cache.py:495-501``).
* ``gpu_worker.py:909-917``: ``initialize_from_config`` does *not* create
  the connector under the extensible cache; ``:936-952`` reserve address
  space for the cache's capacity, commit the null block(s) and set its
  ``reserved_headroom_bytes`` to the profiled peak (activations plus the CUDA
  graph estimate, ``:758-761``).
* ``gpu_worker.py:1023-1103``: warmup, ``run_kv_cache_sizing_warmup``
  (``gpu/warmup.py:452-480`` records the allocated peak and torch's
  reservation growth per sizing step), ``record_transient_peak``
  (``extensible_kv_cache.py:268-278``: the peak kept is the larger of the
  profiled and the warmup peak), then CUDA graph capture; the JIT monitor is
  armed at ``:1214``.
* ``gpu_worker.py:1226-1238`` -> ``measure_kv_cache_blocks``
  (``extensible_kv_cache.py:621-708``): torch's cache emptied, free memory
  measured, ``measure_kv_cache_bytes`` (``:592-618``, modelled here as
  ``measure_kv_cache_bytes``) gives the cache ``min(requested - non-KV
  used, free + committed - margin) - max(peak, growth)``, margin ``max(1
  GiB, 0.75 x peak)`` (``:64-65``, CUDA); torch's allocator is capped at
  what it reserves plus what stays free less 512 MiB
  (``:683-692``, ``set_torch_memory_limit`` ``:377-385``: a per-process
  memory fraction).
* ``engine/core.py:411-418``: the minimum over ranks
  (``core/kv_cache_planning.py:1883``) is committed by ``extend_kv_cache``
  (``extensible_kv_cache.py:489-540``), which only then creates the
  connector (``:587-589``): ``register_kv_caches`` runs in
  ``gpu/kv_connector.py:69``, after warmup, measurement and capture, with
  the cache at its final size in memory torch does not hold.

So at ``register_kv_caches`` (``held``: torch's reservation plus the
committed cache) the free memory is what vLLM keeps free - its peak in full
and its margin (``kept_free``) - plus, where the budget was the bound
rather than the device, the budget's slack ``init_free - requested``.  That
slack is the only room a bank has: at the default utilization 1.0 the
device is the bound and a bank has none (short of the cache's rounding to
whole blocks).  The connector does not see the peak vLLM measured; it takes
an upper bound (``extensible_peak``): the peak whose ``kept_free`` is all
that is free, and no more than vLLM's budget less what it holds - each of
them exact in one regime, and either counting against the bank whatever
vLLM allocated outside torch since its snapshot.  The fit is one rule,
``extensible_room``, and a utilization is planned by it: the largest on a
0.001 grid whose registration, as ``registration_room`` predicts what the
connector will see there, leaves the bank room (``utilization_for``).  Then
the budget is the bound, the cache leaves its slack free, and the bank fits
beside what vLLM keeps - the larger of its peak and torch's growth - and
its margin (tests/test_bank_room_034.py and tests/test_plan_peak_034.py
check it against vLLM's own measure).
Where the device bound the cache, the refusal takes ``init_free`` no more
than ``free + held`` and the margin of the largest peak consistent with
what is free (``free`` less the margin's floor: torch's growth may exceed
the peak the margin is of), so the value it names is accepted when vLLM
starts again - unless vLLM allocates outside torch after its snapshot,
which the next check counts against the bank (up to 1.75 times).
"""
from __future__ import annotations

import math


# vLLM keeps this much below its own budget where it sizes a KV cache
# (gpu_worker.py: "the memory profiling may slightly underestimate").
MARGIN_BYTES = 150 << 20
# vLLM 0.34's extensible KV cache (extensible_kv_cache.py:64-71, on CUDA): the margin beyond its transient peak,
# the larger of a floor and a share of the peak; and what its torch cap leaves free for allocations outside torch.
EXTENSIBLE_MARGIN_FLOOR = 1 << 30
EXTENSIBLE_MARGIN_FRACTION = 0.75
NON_TORCH_RESERVE = 1 << 29
# The grid a suggested --gpu-memory-utilization is rounded down to (0.001 of an H200 is 140 MiB).
UTILIZATION_STEP = 0.001


def measure_kv_cache_bytes(*, init_free_memory: int, free_memory: int, committed_bytes: int, requested_memory: int,
                           transient_peak_bytes: int = 0, torch_reserve_growth_bytes: int = 0,
                           margin_floor_bytes: int = EXTENSIBLE_MARGIN_FLOOR,
                           margin_fraction: float = EXTENSIBLE_MARGIN_FRACTION) -> int:
    """vLLM 0.34's ``measure_kv_cache_bytes`` (``extensible_kv_cache.py:592-618``),
    line for line: the bytes its extensible KV cache takes after warmup."""
    non_kv_used = init_free_memory - free_memory - committed_bytes
    headroom = free_memory + committed_bytes
    margin = max(margin_floor_bytes, int(transient_peak_bytes * margin_fraction))
    available = min(requested_memory - non_kv_used, headroom - margin)
    available -= max(transient_peak_bytes, torch_reserve_growth_bytes)
    return max(available, 0)


def extensible_margin(peak: int) -> int:
    """The margin vLLM 0.34's extensible KV cache keeps beyond its transient ``peak``."""
    return max(EXTENSIBLE_MARGIN_FLOOR, int(peak * EXTENSIBLE_MARGIN_FRACTION))


def kept_free(peak: int, growth: int = 0) -> int:
    """What vLLM 0.34's extensible KV cache keeps free beside itself where
    the device bounds it: the larger of its transient ``peak`` and torch's
    reservation ``growth`` in full, and the margin of the peak."""
    return max(peak, growth) + extensible_margin(peak)


def extensible_peak(free: int, still: int) -> int:
    """An upper bound of the transient peak vLLM 0.34 measured and keeps
    free, from what the connector sees: no more than ``still`` (vLLM's
    budget less what it holds, exact where the budget bound its cache) nor
    than the peak whose ``kept_free`` is all that is ``free`` (exact where the
    device did)."""
    lo, hi = 0, max(0, free)  # kept_free grows with the peak: the largest whose kept_free fits in free
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if kept_free(mid) <= free else (lo, mid - 1)
    peak = lo
    return max(0, min(peak, still))


def extensible_room(free: int, still: int, torch_free: int | None = None) -> tuple[int, int, int]:
    """``(room, peak, margin)`` beside vLLM 0.34's extensible KV cache at
    ``register_kv_caches``: what is ``free`` less the peak it keeps
    (``extensible_peak``; ``still``: its budget less what it holds) and that
    peak's margin, and no more than ``torch_free`` (``allocatable``, where
    vLLM caps torch) less the peak, by which torch grows in every step.  The
    one rule both the connector's fit (``bank_room``) and the plan before
    the engine starts (``registration_room``) apply."""
    peak = extensible_peak(free, still)
    margin = extensible_margin(peak)
    room = free - peak - margin
    if torch_free is not None:
        room = min(room, torch_free - peak)
    return room, peak, margin


def registration_room(requested: int, *, init_free: int, kept: int, non_torch: int = 0) -> int:
    """The room ``extensible_room`` will find at registration in a vLLM 0.34
    engine whose budget is ``requested`` bytes, from its start-up snapshot's
    ``init_free``, the ``kept`` bytes ``measure_kv_cache_bytes`` keeps free
    (the larger of the allocated peak and torch's reservation growth) and
    ``non_torch`` bytes taken outside torch after the snapshot.  Wherever
    this leaves any room the budget bounds the cache (the slack ``init_free
    - requested`` exceeds the margin), which then takes the budget less all
    that vLLM holds and ``kept``: the connector finds ``kept`` free beyond the
    slack, sees ``kept + non_torch`` as vLLM's budget left (it cannot tell
    the two apart), and torch capped ``NON_TORCH_RESERVE`` below what is
    free.  The cache's rounding down to whole blocks adds to both what is
    free and what the budget leaves, like ``non_torch``."""
    free = init_free - requested + kept
    return extensible_room(free, kept + non_torch, free - NON_TORCH_RESERVE)[0]


def utilization_for(nbytes: int, *, init_free: int, total: int, peak: int, non_torch: int = 0) -> float | None:
    """The largest ``--gpu-memory-utilization`` (on the 0.001 grid) under
    which vLLM 0.34's extensible KV cache leaves ``nbytes`` room by the
    connector's own fit (``registration_room``; ``init_free``: the free
    memory at vLLM's start-up snapshot, ``peak``: what it keeps for
    transient activations, ``non_torch``: what is allowed for allocations
    outside torch).  None where no utilization above 0 does."""
    def fits(steps: int) -> bool:
        requested = math.ceil(total * steps * UTILIZATION_STEP)
        return registration_room(requested, init_free=init_free, kept=peak, non_torch=non_torch) >= nbytes

    # the room falls as the budget grows (below 2 bytes once the device bounds the cache): a prefix of the grid fits
    lo, hi = 0, round(1 / UTILIZATION_STEP)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return round(lo * UTILIZATION_STEP, 3) if lo > 0 else None


def allocatable(free: int, total: int, reserved: int, fraction: float) -> int:
    """What torch's allocator can still take on the GPU: its free memory, and
    no more than the cap ``fraction`` x ``total`` less what it ``reserved``
    (vLLM 0.34's extensible KV cache caps torch so that its own later
    allocations find room: ``set_torch_memory_limit``)."""
    return max(0, min(free, math.floor(fraction * total) - reserved))


def vllm_still_needs(*, total: int, utilization: float, held: int) -> int:
    """What vLLM allocates after ``register_kv_caches`` (CUDA graphs, the
    forward's activations), by vLLM's own budget: at start-up it requests
    ``ceil(total x utilization)`` (``request_memory``) and sizes its KV cache
    so that everything it allocates from then on - weights, KV cache, graphs,
    activations - fits in it (``determine_available_memory``).  What it
    still needs is the budget less what it has taken since that snapshot;
    ``held``, the bytes this process's torch allocator holds now (weights and
    KV cache), stands for that: it leaves out the context, NCCL and other
    processes' memory, which were there at the snapshot and are not in the
    budget."""
    return max(0, math.ceil(total * utilization) - held)


def bank_room(*, free: int, total: int, utilization: float, held: int, extensible: bool = False,
              torch_free: int | None = None) -> tuple[int, int, int]:
    """``(room, still, kept)``: the bytes a bank may take on the GPU - what
    is free less what vLLM still needs and the margin kept beside it - with
    those two.  vLLM 0.32's sizing: ``vllm_still_needs`` and 150 MiB.  vLLM
    0.34's extensible KV cache (``extensible``, ``held`` counting the
    committed cache): its transient peak (``extensible_peak``) and that
    peak's margin, and where vLLM caps torch's allocator no more than
    ``torch_free`` less the peak (torch grows by it in every step)."""
    still = vllm_still_needs(total=total, utilization=utilization, held=held)
    if not extensible:
        return free - still - MARGIN_BYTES, still, MARGIN_BYTES
    return extensible_room(free, still, torch_free)


def fit_error(nbytes: int, *, free: int, total: int, utilization: float, held: int,
              kv_cache_memory_bytes: int | None, extensible: bool = False,
              torch_free: int | None = None) -> str | None:
    """Why a bank of ``nbytes`` cannot be uploaded next to vLLM's caches (None: it fits).

    The bank must fit in what is free now less what vLLM still needs and
    its margin (``bank_room``).  With ``--kv-cache-memory-bytes`` vLLM sizes
    no KV cache by utilization (nor knows what it allocates later); the same
    budget is kept, so a smaller KV cache makes room only where that budget
    is used up, and a lower utilization otherwise.  ``extensible``: vLLM
    0.34's extensible KV cache, sized before the connector exists (``held``
    counts its bytes); the utilization named is the largest that leaves the
    bank room by its own sizing (``utilization_for``, from the free memory
    at its start-up no less than ``free + held``); ``torch_free``: what
    torch's allocator can still take where vLLM caps it (``allocatable``).
    """
    room, still, kept = bank_room(free=free, total=total, utilization=utilization, held=held, extensible=extensible,
                                  torch_free=torch_free)
    if nbytes <= room:
        return None
    short, gib = nbytes - room, 2**30
    ways = []
    if extensible:
        # the peak whose margin the next start will keep: no more than all that is free less the margin's floor
        # (it is kept in full beside a margin of at least that), nor than what vLLM's budget leaves it
        bound = min(max(still, free - EXTENSIBLE_MARGIN_FLOOR), vllm_still_needs(total=total, utilization=utilization,
                                                                                   held=held))
        lower = utilization_for(nbytes, init_free=free + held, total=total, peak=bound)
        if lower is not None and lower < utilization:  # vLLM's budget the bound: its slack free, for the bank
            smaller = max(0, held + still - math.ceil(lower * total))  # its slack, less what is free now
            ways.append(f"--gpu-memory-utilization {lower:.3f} or lower (an extensible KV cache about "
                        f"{smaller / gib:.2f} GiB smaller)")
        ways.append("record fewer sequences or positions, or split the bank over more ranks (TP for heads, PP for "
                    "layers, DCP for positions)")
        return (f"this rank's part of the bank takes {nbytes / gib:.2f} GiB; the GPU has {free / gib:.2f} GiB free, "
                f"vLLM's extensible KV cache sized to keep {still / gib:.2f} GiB of them for its transient peak "
                f"and {kept / gib:.2f} GiB of margin (its budget: --gpu-memory-utilization {utilization:g} x "
                f"{total / gib:.2f} GiB), leaving {max(room, 0) / gib:.2f} GiB. Make room for {short / gib:.2f} "
                f"GiB more: " + "; or ".join(ways))
    lower = math.floor((utilization - short / total) * 100) / 100
    if lower > 0 and not kv_cache_memory_bytes:  # vLLM sizes its KV cache that much smaller
        ways.append(f"--gpu-memory-utilization {lower:.2f} or lower (a KV cache that much smaller)")
    elif lower > 0 and still > 0:  # the budget kept for vLLM that much smaller
        ways.append(f"--gpu-memory-utilization {lower:.2f} or lower")
    if kv_cache_memory_bytes and still == 0 and kv_cache_memory_bytes > short:
        ways.append(f"--kv-cache-memory-bytes {kv_cache_memory_bytes - short} or lower")
    ways.append("record fewer sequences or positions, or split the bank over more ranks (TP for heads, PP for "
                "layers, DCP for positions)")
    return (f"this rank's part of the bank takes {nbytes / gib:.2f} GiB; the GPU has {free / gib:.2f} GiB free, "
            f"{still / gib:.2f} GiB of them kept for what vLLM allocates after registering its caches (CUDA "
            f"graphs, activations: its budget of --gpu-memory-utilization {utilization} x {total / gib:.2f} GiB "
            f"less the {held / gib:.2f} GiB it holds) and {kept >> 20} MiB of margin, leaving "
            f"{max(room, 0) / gib:.2f} GiB. Make room for {short / gib:.2f} GiB more: " + "; or ".join(ways))


PLACEMENTS = ("auto", "device", "host")


def device_bytes(placement: str, *, rows: int, states: int, staging: int, rotate: bool = False,
                 tables: int = 0) -> int:
    """The bytes a bank part takes on the GPU where it is kept at
    ``placement`` (``device`` or ``host``): the states and the rotary
    ``tables`` in both, the rows on the device, the staging on the host or
    with ``rotate`` (``choose_placement``)."""
    if placement == "host":
        return states + staging + tables
    return rows + states + tables + (staging if rotate else 0)


def choose_placement(asked: str, *, rows: int, states: int, staging: int, free: int, total: int,
                     utilization: float, held: int, kv_cache_memory_bytes: int | None,
                     rotate: bool = False, extensible: bool = False,
                     torch_free: int | None = None, tables: int = 0) -> tuple[str | None, str]:
    """Where a rank's bank part goes on a GPU, and why: ``(placement, line)``,
    placement None when it fits nowhere asked (``line`` then says why).

    ``device``: rows and states on the GPU beside vLLM's budget
    (``fit_error``), and with ``rotate`` (``past_bank: "rotate"``) the
    staging its turned rows are gathered into; ``host``: the rows in host
    memory, the states and a staging of ``staging`` bytes on the GPU
    (``kvfill/kernels/staging.py``); ``auto``: the device where the whole
    part fits, else the host.  ``tables``: the bytes of the rotary cos/sin
    tables re-rotation keeps on the GPU (one float32 copy per distinct table,
    cut to max_model_len positions; 0 unless rotating), counted in either.
    """
    budget = dict(free=free, total=total, utilization=utilization, held=held, extensible=extensible,
                  torch_free=torch_free)
    gpu = dict(budget, kv_cache_memory_bytes=kv_cache_memory_bytes)
    gib = 2**30
    sizes = dict(rows=rows, states=states, staging=staging, rotate=rotate, tables=tables)
    on_device = device_bytes("device", **sizes)
    with_tables = f" and {tables / 2**20:.0f} MiB of rotary tables" if tables else ""
    whole = fit_error(on_device, **gpu) if asked != "host" else None
    if asked == "device" or (asked == "auto" and whole is None):
        if whole is not None:
            return None, whole + "; or bank_placement 'host' (the rows in host memory, streamed per step)"
        turned = f" with {staging / 2**20:.0f} MiB of staging for keys re-rotated" if rotate else ""
        return "device", (f"bank_placement {asked!r}: the part ({on_device / gib:.2f} GiB{turned}{with_tables}) on the "
                          f"GPU, read in place by every fill")
    staged = fit_error(device_bytes("host", **sizes), **gpu)
    if staged is not None:
        return None, (f"even kept in host memory (bank_placement {asked!r}), the part's recurrent states and its "
                      f"staging ({states / gib:.2f} + {staging / gib:.2f} GiB{with_tables}) do not fit: " + staged)
    room = max(0, bank_room(**budget)[0])
    why = ("asked" if asked == "host" else
           f"the part's {on_device / gib:.2f} GiB exceed the {room / gib:.2f} GiB the GPU has beside "
           f"vLLM's budget")
    return "host", (f"bank_placement {asked!r}: the rows ({rows / gib:.2f} GiB) in host memory, each step's "
                    f"rows streamed to the GPU through {staging / 2**20:.0f} MiB of staging{with_tables} - {why}")
