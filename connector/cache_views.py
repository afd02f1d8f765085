"""How the engine addresses the registered caches: each layer's cache as
the engine takes it (vLLM CPU's attention caches as their real K and V
views, ``cpu_layout.py``; DeepSeek's packed rows as their per-token views,
``packed.py``; other caches as registered).  ``registration.register``
applies them once the bank is loaded, which reads the caches' names,
geometry and device only.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from vllm.logger import init_logger

from .cpu_layout import cpu_attention_parts
from .packed import packed_views

# Under "vllm." so that vLLM's logging configuration (handlers, level) applies.
logger = init_logger("vllm.kvfill.connector")


def platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def with_views(groups: Mapping[str, Any], packed: Mapping[str, str], specs: Mapping[str, Any],
               cache_dtype: str) -> dict[str, Any]:
    """``groups`` (``CacheGroup``s) with each layer's cache as the engine
    takes it (``LayerViews``: ``packed`` layer -> its packed row kind,
    ``specs`` layer -> its spec, vLLM's ``cache_dtype``)."""
    views = LayerViews(packed, specs, cache_dtype)
    return {name: replace(g, layers={n: views.parts(n, c) for n, c in g.layers.items()}) for name, g in groups.items()}


class LayerViews:
    """A layer's cache as the engine takes it: a packed row's per-token
    views, vLLM CPU's attention caches as their K and V views
    (``cpu_layout.py``, with one warning per registration for a layout not
    confirmed), or the cache as registered."""

    def __init__(self, packed: Mapping[str, str], specs: Mapping[str, Any], cache_dtype: str):
        self.packed, self.specs, self.cache_dtype = packed, specs, cache_dtype
        self.on_cpu = platform_is_cpu()
        self.warned = False

    def parts(self, name: str, cache: Any) -> Any:
        if name in self.packed:
            return packed_views(self.packed[name], cache)
        if not self.on_cpu:
            return cache
        parts, ok = cpu_attention_parts(cache, self.specs.get(name), self.cache_dtype)
        if not ok and not self.warned:
            self.warned = True
            logger.warning("KVFillConnector: the CPU attention cache of %s (kv cache dtype %s) is not the "
                           "K-transposed layout kvfill knows; it is filled as registered, so token-granular and "
                           "replay fills do not put each token's K and V at its slot", name, self.cache_dtype)
        return parts
