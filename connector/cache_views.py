"""Registration: the per-layer caches vLLM registers → the engine's
``CacheGroup``s, once per worker.

One group per KV cache group with addressable caches here, each layer's
cache as the engine takes it (vLLM CPU's attention caches as their real K and
V views, ``cpu_layout.py``), each group's fill mode (replaying: zeros or the
synthetic fill for the kinds banks do not record); then the engine's layer ids
(the value function's), the caches' device and the planner told the caches'
slots per block.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from vllm.logger import init_logger

from kvfill.kernels import CacheGroup, FillEngine

from .cpu_layout import cpu_attention_parts
from .options import FillOptions
from .planner import RECORDED_KINDS, GroupKind, Planner

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from .geometry import GroupGeometry

# Under "vllm." so that vLLM's logging configuration (handlers, level) applies.
logger = init_logger("vllm.kvfill.connector")


def platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cache_groups(kv_caches: dict[str, Any], planner_groups, kv_cache_config: "KVCacheConfig", *,
                 unaddressable: set[str], encodings: Mapping[str, str], kv_geometry: Mapping[str, Any],
                 mode: Callable[["GroupGeometry"], str | None],
                 parts: Callable[[str, Any], Any] | None = None) -> dict[str, CacheGroup]:
    """One engine group per KV cache group with addressable caches here.

    Layers of one group sharing one cache tensor are filled once.  Groups
    may alias one buffer (hybrid models): each still fills its own blocks.
    ``mode`` is a group's fill mode (``group_mode``); ``parts`` a layer's
    cache as the engine takes it (vLLM CPU: ``CpuAttentionViews.parts``),
    None for the caches as registered.
    """
    groups: dict[str, CacheGroup] = {}
    for geo, g in zip(planner_groups, kv_cache_config.kv_cache_groups):
        layers, seen = {}, set()
        for name in g.layer_names:
            cache = kv_caches.get(name)
            if cache is None or name in unaddressable:
                continue
            tensors = cache if isinstance(cache, (list, tuple)) else [cache]
            key = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors)
            if key not in seen:
                seen.add(key)
                layers[name] = parts(name, cache) if parts is not None else cache
        if layers:
            groups[geo.name] = CacheGroup(
                layers,
                num_blocks=kv_cache_config.num_blocks,
                encoding={n: encodings.get(n, "auto") for n in layers},
                mode=mode(geo),
                dcp=geo.dcp,
                kv={n: kv_geometry.get(n) for n in layers},
            )
    return groups


def group_mode(geo: "GroupGeometry", options: FillOptions) -> str | None:
    """None: the engine's mode. Replaying, groups the recorder does not
    record get zeros (recurrent state: the empty state) or, for chunked
    local and cross attention, the synthetic fill of fill_mean/fill_std."""
    if geo.zero:
        return "zero"
    if not options.replay or geo.kind in RECORDED_KINDS:
        return None
    if geo.kind == GroupKind.MAMBA:
        return "zero"
    logger.info("KVFillConnector: group %s (%s) is not recorded in banks; it gets the synthetic %s fill",
                geo.name, geo.kind.value, options.values.mode)
    return options.values.mode


class CpuAttentionViews:
    """vLLM CPU attention caches as their K and V views (``cpu_layout.py``),
    with one warning per worker for caches whose layout is not confirmed."""

    def __init__(self, specs: Mapping[str, Any], cache_dtype: str):
        self.specs = specs
        self.cache_dtype = cache_dtype
        self.warned = False

    def parts(self, name: str, cache: Any) -> Any:
        """vLLM CPU attention caches as their K and V views (``cpu_layout.py``); one warning if not."""
        parts, ok = cpu_attention_parts(cache, self.specs.get(name), self.cache_dtype)
        if not ok and not self.warned:
            self.warned = True
            logger.warning("KVFillConnector: the CPU attention cache of %s (kv cache dtype %s) is not the "
                           "K-transposed layout kvfill knows; it is filled as registered, so token-granular and "
                           "replay fills do not put each token's K and V at its slot", name, self.cache_dtype)
        return parts


def layer_ids(kv_caches: dict[str, Any]) -> dict[str, int]:
    """Layer id for the value function, from the number in the layer name
    (``model.layers.7.self_attn.attn`` -> 7), so every pipeline stage numbers
    its layers as the model does; caches sharing a layer's number (a DSA
    layer's latent and indexer) are ``number * m + j``, j their rank by name
    among the m at most of one number; registration order where a name has
    no number."""
    from vllm.model_executor.models.utils import extract_layer_index

    index = {}
    for name in kv_caches:
        try:
            index[name] = extract_layer_index(name)
        except (AssertionError, ValueError):
            return {name: i for i, name in enumerate(kv_caches)}
    by_index: dict[int, list[str]] = {}
    for name in sorted(index):
        by_index.setdefault(index[name], []).append(name)
    m = max((len(v) for v in by_index.values()), default=1)
    return {name: i * m + j for i, names in by_index.items() for j, name in enumerate(names)}


def cache_device(groups: dict[str, CacheGroup]) -> torch.device:
    for g in groups.values():
        for cache in g.layers.values():
            return (cache[0] if isinstance(cache, (list, tuple)) else cache).device
    return torch.device("cpu")


def with_cache_slots(planner: Planner, engine: FillEngine) -> Planner:
    """The planner told how many slots each group's caches hold per block."""
    geos = []
    for geo in planner.groups:
        info = engine.groups.get(geo.name)
        geo = replace(geo, slots_per_block=info.slots_per_block if info else None)
        if geo.remaps_to_whole_blocks:
            logger.warning("KVFillConnector: group %s holds %d slots per block for %d tokens; its planned "
                           "blocks are filled whole", geo.name, geo.slots_per_block, geo.block_size)
        geos.append(geo)
    return Planner(geos, granularity=planner.granularity, null_block_id=planner.null_block_id)
