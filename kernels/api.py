"""Functional entry points: ``fill_blocks`` (a torch custom op) and ``verify_blocks``."""
from __future__ import annotations

from collections import OrderedDict
from typing import Mapping, Sequence

import numpy as np
import torch

from .capture import (  # noqa: F401  (captured_engines, release_captured_fills: public here too)
    captured_engines, check_capture_device, check_capture_ids, pin, pinned, release_captured_fills, stream_capturing,
    whole_block_entries,
)
from .engine import FillEngine
from .layout import default_slot_dim
from .plan import GroupFill
from .registry import CacheGroup
from .verify import VerifyReport


def _flatten(caches) -> list[torch.Tensor]:
    if isinstance(caches, torch.Tensor):
        return [caches]
    if isinstance(caches, Mapping):
        caches = list(caches.values())
    out: list[torch.Tensor] = []
    for c in caches:
        out.extend(_flatten(c) if isinstance(c, (list, tuple, Mapping)) else [c])
    return out


def _ids_array(block_ids) -> np.ndarray:
    if isinstance(block_ids, torch.Tensor):
        block_ids = block_ids.detach().cpu().numpy()
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"block_ids must be a 1-D sequence of ints, got {ids.dtype} shape {ids.shape}")
    return ids.astype(np.int64)


# Engines of recent fill_blocks calls, so repeated calls (and CUDA graph
# capture, which cannot build one) skip registration.  Holds references to the
# caches; clear_engine_cache() drops them.
_ENGINES: OrderedDict = OrderedDict()
_MAX_ENGINES = 8
def clear_engine_cache() -> None:
    """Drop the engines (and cache references) kept for repeated calls.

    Engines of captured fills stay until ``release_captured_fills()``."""
    _ENGINES.clear()


def num_cached_engines() -> int:
    """How many engines recent ``fill_blocks``/``verify_blocks`` calls keep."""
    return len(_ENGINES)


def _key(tensors, block_dim, mean, std, seed, backend) -> tuple:
    return (
        tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, str(t.device)) for t in tensors),
        block_dim, float(mean), float(std), int(seed), backend,
    )


def _engine(tensors, block_dim, mean, std, seed, backend, *, capturing=False) -> FillEngine:
    """One group per distinct block size (slots along the slot dim)."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"caches[{i}]: expected a torch.Tensor, got {type(t).__name__}")
    key = _key(tensors, block_dim, mean, std, seed, backend)
    engine = _ENGINES.get(key) or pinned(key)
    if capturing:
        if engine is None:
            raise RuntimeError(
                "fill_blocks under CUDA graph capture needs a warm-up call with the same caches "
                "and arguments before capture (registration cannot be captured)"
            )
        pin(key, engine)  # the graph addresses its tables
        return engine
    if engine is not None:
        if key in _ENGINES:
            _ENGINES.move_to_end(key)
        return engine
    groups: dict[int, dict[str, torch.Tensor]] = {}
    ids: dict[str, int] = {}
    for i, t in enumerate(tensors):
        nd = t.dim()
        sd = default_slot_dim(nd, block_dim % nd) if nd else None
        bs = t.shape[sd] if sd is not None else 1
        groups.setdefault(bs, {})[f"cache{i}"] = t
        ids[f"cache{i}"] = i
    engine = FillEngine(
        {f"bs{bs}": CacheGroup(layers, block_dim=block_dim) for bs, layers in groups.items()},
        mean=mean,
        std=std,
        seed=seed,
        backend=backend,
        layer_ids=ids,
    )
    # Compile now: a warm-up call before capture may fill nothing (no ids), and
    # a first launch inside capture would load a module, which CUDA forbids.
    engine.warmup()
    _ENGINES[key] = engine
    while len(_ENGINES) > _MAX_ENGINES:
        _ENGINES.popitem(last=False)
    return engine


def _fill_captured(engine: FillEngine, block_ids: torch.Tensor) -> None:
    """Inside CUDA graph capture: the plan is built on the device (capture.py)."""
    check_capture_device(engine.device)
    check_capture_ids(block_ids, engine.device)
    if block_ids.numel() == 0:
        return
    for g, info in engine.groups.items():
        engine.fill_device_entries(g, whole_block_entries(block_ids, info.num_blocks, info.slots_per_block))


def _whole_blocks_plan(engine: FillEngine, ids: np.ndarray) -> dict[str, GroupFill]:
    # The i-th id holds tokens [i * bs, (i + 1) * bs): block_ids read as one
    # request's block table, so two placements hold the same logical KV.  A
    # repeated id keeps its first position, so duplicates are idempotent.
    _, first = np.unique(ids, return_index=True)
    first.sort()
    out = {}
    for g, info in engine.groups.items():
        out[g] = GroupFill(block_ids=ids[first], local_base=first * info.slots_per_block)
    return out


@torch.library.custom_op("kvfill::fill_blocks", mutates_args=("caches",))
def _fill_blocks_op(
    caches: list[torch.Tensor],
    block_ids: torch.Tensor,
    block_dim: int,
    mean: float,
    std: float,
    seed: int,
    backend: str,
) -> None:
    if stream_capturing():
        _fill_captured(_engine(caches, block_dim, mean, std, seed, backend, capturing=True), block_ids)
        return
    engine = _engine(caches, block_dim, mean, std, seed, backend)
    engine.fill(_whole_blocks_plan(engine, _ids_array(block_ids)))


@_fill_blocks_op.register_fake
def _(caches, block_ids, block_dim, mean, std, seed, backend) -> None:
    return None


def fill_blocks(
    caches: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    block_ids: Sequence[int] | torch.Tensor,
    *,
    block_dim: int = 0,
    mean: float = 0.015,
    std: float = 0.0,
    seed: int = 0,
    backend: str = "auto",
) -> None:
    """Fill every element of the given blocks of each cache, and nothing else.

    caches: one tensor, a sequence (nested lists are flattened: Mamba state
        lists) or a mapping of tensors.  Any strided layout whose indices have
        distinct addresses, e.g. vLLM's per-layer ``[num_blocks, H, N, C]`` in
        any of its six physical orders, ``[2, num_blocks, N, H, D]``
        (``block_dim=1``), ``[num_blocks, 2, N, H, D]`` (NHD or HND strides),
        MLA ``[num_blocks, N, D]``, state rows ``[num_blocks, ...]``.
        dtypes: float32/float16/bfloat16/float8_e4m3fn/float8_e5m2; uint8 holds
        fp8 e4m3fn (vLLM's ``fp8`` cache dtype stored as bytes).
    block_ids: ``int[n]``, indices along ``block_dim``; every id must be in
        ``[0, shape[block_dim])`` of every cache or ValueError is raised before
        anything is written.  Duplicates are allowed (idempotent).
    mean, std: ``std == 0`` writes ``mean`` everywhere (rounded to the dtype,
        clamped to its finite range); ``std > 0`` writes ``mean + std * z``,
        ``z`` standard normal, reproducible from ``seed``.
    backend: ``auto`` (Triton for GPU tensors, torch for CPU tensors),
        ``triton`` or ``torch``.

    Values are a function of (seed, cache index, token position, element): the
    i-th id's block holds tokens ``[i * N, (i + 1) * N)`` where ``N`` is the
    slot dim's size (dim 2 of >=4-d caches, dim 1 of 3-d caches); a repeated
    id keeps the position of its first occurrence.

    Example::

        cache = torch.zeros(128, 8, 16, 256, dtype=torch.bfloat16)  # [B, H, N, C]
        fill_blocks([cache], [3, 17, 42], mean=0.0, std=1.0, seed=1)

    Registered as the custom op ``torch.ops.kvfill.fill_blocks`` (mutating
    ``caches``), so it can be called inside ``torch.compile``d code.  Under
    CUDA graph capture, call it once before capture with the same caches and
    arguments, and pass ``block_ids`` as a tensor on the caches' device (host
    ids are refused): the captured fill builds its plan on the device by the
    same rules, skips out-of-range ids instead of raising (the host cannot see
    them), reads the ids at replay and pins its engine until
    ``release_captured_fills()`` (``kvfill.kernels.capture``).
    """
    tensors = _flatten(caches)
    # Before any conversion: host ids are refused under capture.  Not while
    # Dynamo traces (vLLM compiles with fullgraph=True): it cannot trace the
    # capture query, and the op checks again when it runs.
    if tensors and not torch.compiler.is_compiling() and stream_capturing():
        check_capture_ids(block_ids, tensors[0].device)
    if isinstance(block_ids, torch.Tensor):
        ids = block_ids.to(torch.int64)  # validated inside the op (traceable here)
    else:
        ids = torch.from_numpy(_ids_array(block_ids))
    torch.ops.kvfill.fill_blocks(tensors, ids, block_dim, float(mean), float(std), int(seed), backend)


def verify_blocks(
    caches,
    block_ids,
    *,
    block_dim: int = 0,
    mean: float = 0.015,
    std: float = 0.0,
    seed: int = 0,
    backend: str = "auto",
) -> VerifyReport:
    """Check that the given blocks hold what ``fill_blocks`` with the same
    arguments writes; returns a report with ``.ok``, ``.num_mismatched`` and
    the first offenders (layer, block, slot, element, expected, found)."""
    engine = _engine(_flatten(caches), block_dim, mean, std, seed, backend)
    return engine.verify(_whole_blocks_plan(engine, _ids_array(block_ids)))

