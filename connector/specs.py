"""vLLM KV cache specs -> planner geometry (with ``states.py``: state specs -> the bank's state layout).

A group's DCP world size W (``dcp_world_size_of``) is resolved exactly as the
installed vLLM's allocator resolves it: newer vLLM's per-spec helper
``dcp_world_size_for_kv_cache_spec`` when it exists, else the spec's
``dcp_sharded`` flag (vLLM 0.32/0.33: true for every attention spec, chunked
local and sliding window included; false for Mamba), else - vLLM trees older
than both - full attention (MLA included) is sharded and nothing else is.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVQuantMode,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvfill.bank import DcpGeometry
from kvfill.kernels import values as V

from .planner import GroupGeometry, GroupKind, Planner, RequestSelection


def layer_specs(spec: KVCacheSpec) -> list[KVCacheSpec]:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return list(spec.kv_cache_specs.values())
    return [spec]


# Subclasses before their bases: SlidingWindowMLASpec is a SlidingWindowSpec,
# MLA / sink attention are FullAttentionSpecs.
_KINDS = (
    (CircularBufferSpec, GroupKind.CIRCULAR_BUFFER),
    (SlidingWindowSpec, GroupKind.SLIDING_WINDOW),
    (ChunkedLocalAttentionSpec, GroupKind.CHUNKED_LOCAL),
    (CrossAttentionSpec, GroupKind.CROSS_ATTENTION),
    (MambaSpec, GroupKind.MAMBA),
    (FullAttentionSpec, GroupKind.FULL_ATTENTION),
)


def spec_kind(spec: KVCacheSpec) -> GroupKind:
    """The planner kind of a (group or layer) spec."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {spec_kind(s) for s in layer_specs(spec)}
        if len(kinds) != 1:
            raise ValueError(f"a uniform-type group mixes kinds {sorted(k.value for k in kinds)}")
        return kinds.pop()
    for cls, kind in _KINDS:
        if isinstance(spec, cls):
            return kind
    return GroupKind.OTHER


def dcp_world_size_of(spec: KVCacheSpec, dcp_world_size: int) -> int:
    """W of a group, as the installed vLLM resolves it (module docstring)."""
    if dcp_world_size == 1:
        return 1
    from vllm.v1.core import kv_cache_utils

    helper = getattr(kv_cache_utils, "dcp_world_size_for_kv_cache_spec", None)
    if helper is not None:
        return helper(spec, dcp_world_size)
    sharded = getattr(spec, "dcp_sharded", None)
    if sharded is None:
        sharded = spec_kind(spec) == GroupKind.FULL_ATTENTION
    return dcp_world_size if sharded else 1


def platform_fp8_encoding() -> str:
    """The encoding of vLLM's ``fp8``/``fp8_e4m3`` caches stored as uint8: its
    kernels read them as the platform's fp8 type (e4m3fnuz on ROCm MI300)."""
    from vllm.platforms import current_platform

    return V.ENC_FP8_E4M3FNUZ if current_platform.fp8_dtype() == torch.float8_e4m3fnuz else V.ENC_FP8_E4M3


def layer_encoding(spec: KVCacheSpec, cache_dtype: str | None = None) -> str:
    """How a layer's cache bytes encode values (kvfill.kernels.values encodings).

    Float dtypes hold themselves; uint8 holding plain per-tensor fp8 is the
    platform's fp8 e4m3 type or e5m2 by the cache dtype; every other uint8/int layout (nvfp4,
    fp8 with embedded scales, int metadata) is ``packed`` and zero-filled, and
    so is a float cache of another quantization mode than none or per-tensor
    fp8 (vLLM 0.34's ``KVCacheDTypeHandler`` dtypes may store a format of
    their own, ``KVQuantMode.CUSTOM``, in a float dtype).
    """
    dtype = getattr(spec, "dtype", None)
    if isinstance(spec, MambaSpec):
        # vLLM 0.32+ registers a Mamba layer as one raw byte view per block
        # ([num_blocks, 1, 1, page_bytes]) packing states of several dtypes:
        # zeroed, the defined empty state.
        return V.ENC_PACKED
    mode = getattr(spec, "kv_quant_mode", KVQuantMode.NONE)
    if dtype in V.FLOAT_DTYPES and mode in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
        return V.ENC_NATIVE
    if (
        isinstance(spec, AttentionSpec)
        and dtype == torch.uint8
        and spec.kv_quant_mode == KVQuantMode.FP8_PER_TENSOR
        and spec.state_content_bytes is None
    ):
        cd = getattr(spec, "cache_dtype_str", None) or cache_dtype
        if cd in ("fp8", "fp8_e4m3"):
            return platform_fp8_encoding()
        if cd == "fp8_e5m2":
            return V.ENC_FP8_E5M2
    return V.ENC_PACKED


def group_geometry(
    name: str, spec: KVCacheSpec, *, dcp_world_size: int = 1, interleave: int = 1
) -> GroupGeometry:
    """The planner's geometry of one group (DCP rank 0: ``Planner.for_rank`` sets a worker's)."""
    kind = spec_kind(spec)
    world = dcp_world_size_of(spec, dcp_world_size)
    return GroupGeometry(
        name=name,
        kind=kind,
        block_size=spec.block_size,
        dcp=DcpGeometry(world, 0, interleave if world > 1 else 1),
        zero_fill=kind == GroupKind.CIRCULAR_BUFFER,
    )


def geometries_from_config(vllm_config: Any, kv_cache_config: Any) -> list[GroupGeometry]:
    """One geometry per KV cache group of ``kv_cache_config``, named ``group{i}``."""
    par = vllm_config.parallel_config
    dcp = par.decode_context_parallel_size
    tp = par.tensor_parallel_size
    pcp = getattr(par, "prefill_context_parallel_size", 1)
    if pcp == 1 and tp % dcp:
        raise ValueError(f"DCP size {dcp} does not divide the TP size {tp}, as vLLM requires")
    interleave = par.cp_kv_cache_interleave_size
    return [
        group_geometry(f"group{i}", g.kv_cache_spec, dcp_world_size=dcp, interleave=interleave)
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    ]


def startup_fill_group_ids(kv_cache_config: Any) -> set[int]:
    """Groups a startup fill covers: not circular buffers (zeroed per request),
    not attention groups the engine zeroes on allocation (that wipes the fill)."""
    out = set()
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        if not transferred(g):
            continue
        if any(spec_kind(s) == GroupKind.CIRCULAR_BUFFER for s in layer_specs(g.kv_cache_spec)):
            continue
        if getattr(kv_cache_config, "needs_kv_cache_zeroing", False) and isinstance(g.kv_cache_spec, AttentionSpec):
            continue
        out.add(i)
    return out


def filled_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """Groups kvfill writes a request's blocks of: every group vLLM transfers
    (``untransferred_layers``) with a layer that has per-layer cache views -
    not raw backing buffers a layer lays out itself (HiSparse), which have
    no block dim to address."""
    return tuple(i for i, g in enumerate(kv_cache_config.kv_cache_groups)
                 if transferred(g) and any(getattr(s, "has_layer_views", True) for s in layer_specs(g.kv_cache_spec)))


def untransferred_layers(kv_cache_config: Any) -> dict[str, int]:
    """Layers of the groups vLLM keeps out of KV transfer (a group's
    ``enable_kv_transfer`` False: HiSparse's hot and resident tiers, replicas
    vLLM rebuilds from their source group after a load) -> group index.
    kvfill never fills, records or replays them: what it writes into the
    source group is what vLLM copies there."""
    return {name: i for i, g in enumerate(kv_cache_config.kv_cache_groups)
            if not transferred(g) for name in g.layer_names}


def transferred(group: Any) -> bool:
    """Whether vLLM transfers this KV cache group's blocks (``enable_kv_transfer``;
    vLLM 0.32/0.33 groups without the field always)."""
    return getattr(group, "enable_kv_transfer", True)


def layer_specs_by_name(kv_cache_config: Any) -> dict[str, KVCacheSpec]:
    """Layer name -> that layer's own spec (uniform-type groups hold one per layer)."""
    out = {}
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        for name in g.layer_names:
            out[name] = spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec
    return out


def layer_kv_geometry(spec: KVCacheSpec) -> tuple[int, int, int] | None:
    """``(num_kv_heads, head_size, head_size_v)`` of an attention layer's
    cache on this worker (MLA: one head of the latent row, ``head_size_v``
    0): how a bank's canonical rows map onto it (``kvfill.bank.rows``).
    None for other specs (recurrent state keeps its own order)."""
    if not isinstance(spec, AttentionSpec):
        return None
    return int(spec.num_kv_heads), int(spec.head_size), int(spec.head_size_v)


def _block_ids(blocks) -> list[int]:
    # A list comprehension: faster here than map/attrgetter or np.fromiter.
    return [b.block_id for b in blocks]


def select_request(
    planner: Planner, request: Any, kv_blocks: Any, num_external_tokens: int, num_local: int | None = None,
    skip_groups: Any = (), sequence: int = 0, sequences_at: Any = None, tail: int = 1,
) -> RequestSelection:
    """Planner selection from vLLM's scheduler objects.

    ``request``: a vLLM ``Request`` (``request_id``, ``num_tokens``);
    ``kv_blocks``: its ``KVCacheBlocks``; ``num_external_tokens``: what the
    scheduler granted; ``num_local``: the locally computed prefix the
    connector was asked about (default ``num_tokens - tail - num_external_tokens``,
    exact unless the scheduler trimmed the grant; ``tail``: the prompt tokens
    vLLM computes itself, ``scheduler.computed_tail``); ``skip_groups``: groups not
    to fill; ``sequence``, ``sequences_at``: the bank sequences it replays
    (``Planner.select``).  Only the selected
    blocks' ids are read.
    """
    if num_local is None:
        num_local = request.num_tokens - tail - num_external_tokens
    return planner.select(request.request_id, request.num_tokens, num_local, kv_blocks.blocks, _block_ids,
                          num_external=num_external_tokens, skip_groups=skip_groups, sequence=sequence,
                          sequences_at=sequences_at)
