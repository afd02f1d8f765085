"""Whether a rank's part of a bank fits its GPU beside what vLLM still
allocates, by vLLM's own memory budget (``vllm/v1/worker/gpu_worker.py``:
``request_memory``, ``determine_available_memory``).  Plain arithmetic, no
vLLM import: the device image (no vLLM) tests it too.
"""
from __future__ import annotations

import math


# vLLM keeps this much below its own budget where it sizes a KV cache
# (gpu_worker.py: "the memory profiling may slightly underestimate").
MARGIN_BYTES = 150 << 20
# vLLM 0.34's extensible KV cache keeps its transient peak free and, beyond it, a margin of the larger of
# these (extensible_kv_cache.py: KV_CACHE_MARGIN_FLOOR_BYTES on CUDA, KV_CACHE_MARGIN_FRACTION of the peak).
EXTENSIBLE_MARGIN_FLOOR = 1 << 30
EXTENSIBLE_MARGIN_FRACTION = 0.75


def margin(still: int, extensible: bool) -> int:
    """What a bank leaves free beyond what vLLM still needs: vLLM 0.32's
    margin, or under vLLM 0.34's extensible KV cache the margin it keeps
    beside its transient peak (``still`` standing for that peak)."""
    if not extensible:
        return MARGIN_BYTES
    return max(EXTENSIBLE_MARGIN_FLOOR, int(still * EXTENSIBLE_MARGIN_FRACTION))


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
    is free less what vLLM still needs (``vllm_still_needs``) and the margin
    kept beside it (``margin``), and where vLLM caps torch's allocator no
    more than ``torch_free`` less what vLLM still needs - with those two."""
    still = vllm_still_needs(total=total, utilization=utilization, held=held)
    kept = margin(still, extensible)
    room = free - still - kept
    if torch_free is not None:
        room = min(room, torch_free - still)
    return room, still, kept


def fit_error(nbytes: int, *, free: int, total: int, utilization: float, held: int,
              kv_cache_memory_bytes: int | None, extensible: bool = False,
              torch_free: int | None = None) -> str | None:
    """Why a bank of ``nbytes`` cannot be uploaded next to vLLM's caches (None: it fits).

    The bank must fit in what is free now less what vLLM still needs
    (``vllm_still_needs``) and vLLM's own margin.  With
    ``--kv-cache-memory-bytes`` vLLM sizes no KV cache by utilization (nor
    knows what it allocates later); the same budget is kept, so a smaller KV
    cache makes room only where that budget is used up, and a lower
    utilization otherwise.  ``extensible``: vLLM 0.34's extensible KV cache,
    sized before the connector exists (``held`` counts its bytes) and kept
    beside its transient peak and a margin (``margin``); ``torch_free``:
    what torch's allocator can still take where vLLM caps it
    (``allocatable``), which must hold the bank and what vLLM still needs.
    """
    room, still, kept = bank_room(free=free, total=total, utilization=utilization, held=held, extensible=extensible,
                                  torch_free=torch_free)
    if nbytes <= room:
        return None
    short, gib = nbytes - room, 2**30
    ways = []
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


def choose_placement(asked: str, *, rows: int, states: int, staging: int, free: int, total: int,
                     utilization: float, held: int, kv_cache_memory_bytes: int | None,
                     rotate: bool = False, extensible: bool = False,
                     torch_free: int | None = None) -> tuple[str | None, str]:
    """Where a rank's bank part goes on a GPU, and why: ``(placement, line)``,
    placement None when it fits nowhere asked (``line`` then says why).

    ``device``: rows and states on the GPU beside vLLM's budget
    (``fit_error``), and with ``rotate`` (``past_bank: "rotate"``) the
    staging its turned rows are gathered into; ``host``: the rows in host
    memory, the states and a staging of ``staging`` bytes on the GPU
    (``kvfill/kernels/staging.py``); ``auto``: the device where the whole
    part fits, else the host.
    """
    budget = dict(free=free, total=total, utilization=utilization, held=held, extensible=extensible,
                  torch_free=torch_free)
    gpu = dict(budget, kv_cache_memory_bytes=kv_cache_memory_bytes)
    gib = 2**30
    on_device = rows + states + (staging if rotate else 0)
    whole = fit_error(on_device, **gpu) if asked != "host" else None
    if asked == "device" or (asked == "auto" and whole is None):
        if whole is not None:
            return None, whole + "; or bank_placement 'host' (the rows in host memory, streamed per step)"
        turned = f" with {staging / 2**20:.0f} MiB of staging for keys re-rotated" if rotate else ""
        return "device", (f"bank_placement {asked!r}: the part ({on_device / gib:.2f} GiB{turned}) on the GPU, "
                          f"read in place by every fill")
    staged = fit_error(states + staging, **gpu)
    if staged is not None:
        return None, (f"even kept in host memory (bank_placement {asked!r}), the part's recurrent states and its "
                      f"staging ({states / gib:.2f} + {staging / gib:.2f} GiB) do not fit: " + staged)
    room = max(0, bank_room(**budget)[0])
    why = ("asked" if asked == "host" else
           f"the part's {on_device / gib:.2f} GiB exceed the {room / gib:.2f} GiB the GPU has beside "
           f"vLLM's budget")
    return "host", (f"bank_placement {asked!r}: the rows ({rows / gib:.2f} GiB) in host memory, each step's "
                    f"rows streamed to the GPU through {staging / 2**20:.0f} MiB of staging - {why}")
