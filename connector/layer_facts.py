"""What vLLM's configs say about this worker's caches before it registers
them: each layer's spec, encoding and K/V geometry, DeepSeek's packed rows,
the layers registration leaves unfilled, the recurrent-state layers, the
startup-fill groups, the worker's ranks and its planner - read once, when
the worker is made (the layouts kvfill refuses are refused then), and kept
whole in ``registration.Registration``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from .options import FillOptions
from .packed import compressed_in_mixed_groups, packed_encoding, packed_row_kind, refuse_layouts
from .planner import GroupKind, Planner
from .specs import (
    geometries_from_config, layer_encoding, layer_kv_geometry, layer_specs_by_name, spec_kind, startup_fill_group_ids,
    untransferred_layers,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class Ranks:
    """This worker's place in vLLM's parallel groups (``ranks.py``)."""

    tp: int
    tp_size: int
    pp: int
    dcp: int


@dataclass(frozen=True)
class LayerFacts:
    """The configs' facts about this worker's layers (module docstring)."""

    ranks: Ranks
    kv_cache_config: Any  # vLLM's KVCacheConfig, as the connector was made with it
    planner: Planner  # this rank's, before the caches say their slots per block
    specs: Mapping[str, Any]  # layer -> its own KVCacheSpec
    cache_dtype: str
    max_model_len: int  # positions a request can have (0: not known)
    encodings: Mapping[str, str]  # layer -> how its bytes encode values (kernels.values)
    kv_geometry: Mapping[str, Any]  # layer -> (KV heads, head size, V head size); None: a packed row's own order
    packed: Mapping[str, str]  # DeepSeek's sparse-attention rows: layer -> its packed row kind (packed.py)
    unaddressable: frozenset  # raw backing buffers with no block dim (HiSparse): never filled
    untransferred: Mapping[str, int]  # layers of groups vLLM keeps out of KV transfer -> group index
    left_out: Mapping[str, Any]  # compressed layers sharing a group with per-token ones: not fillable, named
    state_layers: frozenset  # recurrent-state (Mamba / linear attention) layers
    startup_groups: frozenset  # group indices a startup fill covers (none without ``startup_fill``)

    @property
    def unfilled(self) -> set[str]:
        """Every layer registration leaves out of the engine."""
        return set(self.unaddressable) | set(self.left_out) | set(self.untransferred)


def read_layer_facts(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", options: FillOptions,
                     ranks: Ranks) -> LayerFacts:
    """The facts of ``kv_cache_config``'s layers on this worker; raises for a
    layout kvfill refuses (vLLM 0.34's head-major K/V slots)."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    specs = layer_specs_by_name(kv_cache_config)
    encodings = {name: layer_encoding(spec, cache_dtype) for name, spec in specs.items()}
    kv_geometry = {name: layer_kv_geometry(spec) for name, spec in specs.items()}
    # DeepSeek's sparse-attention rows (packed.py): per-token views, values their readers decode
    # (zero_packed: their tokens' bytes get zeros, as the in-tree connector writes)
    packed = {name: kind for name, spec in specs.items() if (kind := packed_row_kind(spec)) is not None}
    for name, kind in packed.items():
        encodings[name] = packed_encoding(kind, options.values, zero=options.zero_packed)
        kv_geometry[name] = None  # a packed row keeps its own order
    untransferred = untransferred_layers(kv_cache_config)  # vLLM 0.34's HiSparse tiers: never filled
    refuse_layouts(specs, skip=untransferred)  # vLLM 0.34's head-major K/V slots: refused at start
    model_config = getattr(vllm_config, "model_config", None)
    return LayerFacts(
        ranks=ranks,
        kv_cache_config=kv_cache_config,
        planner=Planner(geometries_from_config(vllm_config, kv_cache_config),
                        granularity=options.granularity).for_rank(ranks.dcp),
        specs=specs,
        cache_dtype=cache_dtype,
        max_model_len=int(getattr(model_config, "max_model_len", 0) or 0),
        encodings=encodings,
        kv_geometry=kv_geometry,
        packed=packed,
        unaddressable=frozenset(n for n, s in specs.items() if not getattr(s, "has_layer_views", True)),
        untransferred=untransferred,
        left_out=compressed_in_mixed_groups(kv_cache_config.kv_cache_groups, specs),
        state_layers=frozenset(n for n, s in specs.items() if spec_kind(s) == GroupKind.MAMBA),
        startup_groups=frozenset(startup_fill_group_ids(kv_cache_config) if options.startup_fill else ()),
    )
