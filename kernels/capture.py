"""Fills recorded into CUDA graphs: capture state, device-built plans, lifetime.

Contract of a captured ``fill_blocks`` (README, "CUDA graphs"):

* A call with the same caches and arguments must run before capture: building
  an engine (layouts, device tables) cannot be captured.
* Under capture ``block_ids`` must be a tensor on the caches' device; host ids
  (lists, arrays, CPU tensors for GPU caches) are refused before anything
  else, since a host-to-device copy recorded into a graph would replay stale
  or freed staging memory.
* The plan is built on the device with fixed-size ops, by the same rules as a
  host-built one: the i-th id holds tokens ``[i * S, (i + 1) * S)``; a
  repeated id keeps its first position; an id outside ``[0, num_blocks)`` -
  including one past int32 - writes nothing.  The ids are read at replay.
* The graph holds raw addresses of the engine's layer table and value table
  (and, replaying, its device copy of the bank).  The engine of a captured
  fill is pinned: neither the engine cache's eviction nor
  ``clear_engine_cache()`` drops it, only ``release_captured_fills()``, which
  must not be called while a graph that holds such a fill may replay.

The same holds for a user-held ``FillEngine`` whose ``fill_device_entries``
is captured (the only way to capture a replay fill): it must have been warmed
up (``FillEngine.warmup()``: a first launch would load a module, which capture
forbids), and capturing pins it until ``release_captured_fills()``, so
dropping the last reference to it does not free what the graph reads.
"""
from __future__ import annotations

import torch

INT32_MAX = 2**31 - 1

# Engines whose fills were captured into CUDA graphs, by key: fill_blocks'
# engine-cache key, or ("engine", id) for a user-held engine.
_PINNED: dict = {}


def pin(key, engine) -> None:
    """Keep ``engine`` alive until ``release_captured_fills()``: a captured graph addresses its tables."""
    _PINNED[key] = engine


def pinned(key):
    """The engine pinned under ``key``, or None."""
    return _PINNED.get(key)


def captured_engines() -> tuple:
    """The engines pinned by fills captured into CUDA graphs (each once)."""
    return tuple({id(e): e for e in _PINNED.values()}.values())


def release_captured_fills() -> None:
    """Unpin the engines of captured fills.  Call it only once no graph that
    holds such a fill can replay: the graph addresses the engine's tables."""
    _PINNED.clear()


def cuda_available() -> bool:
    """``torch.cuda.is_available()``; its own name so a CPU test can report
    CUDA here alone (patching torch's breaks torch.compile's own probes)."""
    return torch.cuda.is_available()


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA).

    Not traceable by Dynamo (a torch function returning a bool): callers
    skip it while ``torch.compiler.is_compiling()``."""
    return cuda_available() and torch.cuda.is_current_stream_capturing()


def check_capture_device(device: torch.device) -> None:
    """Under capture, refuse caches on a GPU other than the current one:
    capture records the current device's stream, so a launch on another
    device's stream would run once, eagerly, and be missing from the graph."""
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        raise RuntimeError(
            f"under CUDA graph capture the caches' device ({device}) must be the current device "
            f"(cuda:{torch.cuda.current_device()}): the fill would run on an uncaptured stream"
        )


def check_capture_ids(block_ids, device: torch.device) -> None:
    """Under capture, refuse block ids that are not a tensor on ``device``."""
    if isinstance(block_ids, torch.Tensor) and block_ids.device == device:
        return
    got = f"a tensor on {block_ids.device}" if isinstance(block_ids, torch.Tensor) else type(block_ids).__name__
    raise RuntimeError(
        f"under CUDA graph capture, block_ids must be a tensor on the caches' device ({device}); got {got}. "
        "Host ids would be copied by the graph from a staging buffer that is gone at replay."
    )


def whole_block_entries(block_ids: torch.Tensor, num_blocks: int, slots_per_block: int) -> torch.Tensor:
    """Plan entries ``int32 [n, 4]`` filling each id's block whole, built with
    fixed-size device ops only (capturable, no host sync); see the module
    docstring for the rules.  Skipped ids get block -1, which the kernel
    writes nothing for."""
    ids = block_ids.reshape(-1).to(torch.int64)
    n = ids.numel()
    pos = torch.arange(n, dtype=torch.int64, device=ids.device)
    base = pos * slots_per_block
    valid = (ids >= 0) & (ids < num_blocks) & (base + slots_per_block <= INT32_MAX)
    # Repeats: after a stable sort, an id equal to its left neighbour is a
    # later occurrence; the first keeps its (lowest) position.
    sorted_ids, order = torch.sort(ids, stable=True)
    later_sorted = torch.zeros(n, dtype=torch.bool, device=ids.device)
    later_sorted[1:] = sorted_ids[1:] == sorted_ids[:-1]
    later = torch.empty_like(later_sorted).scatter_(0, order, later_sorted)
    keep = valid & ~later
    block = torch.where(keep, ids, -1).to(torch.int32)
    base = torch.where(keep, base, 0).to(torch.int32)
    return torch.stack(
        [block, torch.zeros_like(block), torch.full_like(block, slots_per_block), base], dim=1
    ).contiguous()
