"""vLLM's state layers (``MambaSpec``: gated delta-net, Mamba-1/2, short
conv, linear attention) as the bank's state section sees them
(``kvfill/bank/state.py``): each state tensor's full (TP 1) shape and how
tensor parallelism cuts it, derived from the spec's per-rank shapes and the
layer's kind - the cuts vLLM's weight loaders make:

* a conv state ``[state_len, channels]`` (``[channels, state_len]`` when
  vLLM's conv layout is dim-first) is cut along its channels; gated
  delta-net's channels are q, k and v (``head_k_dim * k_heads`` twice, then
  ``head_v_dim * v_heads``: ``MergedColumnParallelLinear``, each part
  sharded on its own), Mamba-2's are x, B and C (``intermediate``, then
  ``n_groups * d_state`` twice), Mamba-1's and short conv's one block;
* a recurrent (temporal / ssm) state is cut along its heads, dim 0;
* a spec marked ``tp_replicated`` is whole on every rank.

The sizes of q/k/v and x/B/C come from the recurrent state's shape (its
heads x head dims), so no model config is read.  Mamba-2 with fewer groups
than ranks (vLLM replicates groups then) cuts differently: a bank recorded so
is refused at load by its shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import MambaSpec

from kvfill.bank.state import StateTensor
from kvfill.kernels.state_pages import StatePages

if TYPE_CHECKING:
    from kvfill.bank import Bank

    from .layer_facts import LayerFacts

# Under "vllm." so that vLLM's logging configuration (handlers, level) applies.
logger = init_logger("vllm.kvfill.connector")

_CONV_FIRST_KINDS = ("MAMBA1", "MAMBA2", "SHORT_CONV", "GDN_ATTN")  # state 0 is the conv state


def conv_dim_first() -> bool:
    """Whether vLLM lays conv states out ``[channels, state_len]``."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:
        return False
    return bool(is_conv_state_dim_first())


def has_recurrent_state(model_config) -> bool:
    """Whether vLLM's model config names layers with recurrent state (a
    hybrid or a pure Mamba model): what a recording then keeps per sequence."""
    return bool(getattr(model_config, "has_inner_state", False) or getattr(model_config, "is_hybrid", False))


def mamba_kind(spec: MambaSpec) -> str:
    kind = getattr(spec, "mamba_type", None)
    return str(getattr(kind, "name", kind))


def state_alignment(spec: MambaSpec) -> int:
    """The byte alignment of each state in the layer's page: vLLM 0.34's
    ``MambaSpec.state_alignment`` (16 under FlashInfer's ReplaySSM: each
    state starts at, and takes, a multiple of it); 1 on vLLM without it."""
    return int(getattr(spec, "state_alignment", 1) or 1)


def state_layout(spec: MambaSpec, tp_size: int, dim_first: bool | None = None) -> tuple[StateTensor, ...]:
    """The full state tensors of a layer whose spec (this rank's shapes) is
    ``spec`` at tensor parallel size ``tp_size``."""
    dim_first = conv_dim_first() if dim_first is None else dim_first
    shapes = [tuple(int(x) for x in s) for s in spec.shapes]
    dtypes = list(spec.dtypes)
    if getattr(spec, "tp_replicated", False):
        return tuple(StateTensor(s, d, None) for s, d in zip(shapes, dtypes))
    kind = mamba_kind(spec)
    t = int(tp_size)
    out = []
    for i, (s, d) in enumerate(zip(shapes, dtypes)):
        dim = (0 if dim_first else 1) if i == 0 and kind in _CONV_FIRST_KINDS and len(s) == 2 else 0
        full = s[:dim] + (s[dim] * t,) + s[dim + 1:]
        segments = (full[dim],)
        if i == 0 and dim == (0 if dim_first else 1) and len(shapes) > 1 and len(shapes[1]) == 3:
            heads, d1, d2 = shapes[1]
            if kind == "GDN_ATTN":  # recurrent [v_heads, v_dim, k_dim]: q and k are k_dim-wide heads
                v = heads * t * d1
                k = (full[dim] - v) // 2
                segments = (k, k, v) if k > 0 and 2 * k + v == full[dim] else segments
            elif kind == "MAMBA2":  # recurrent [heads, head_dim, d_state]: x is heads x head_dim
                x = heads * t * d1
                g = (full[dim] - x) // 2
                segments = (x, g, g) if g > 0 and x + 2 * g == full[dim] else segments
        out.append(StateTensor(full, d, dim, segments))
    return tuple(out)


def state_bytes_per_sequence(vllm_config) -> int:
    """The bytes one recorded sequence's state section takes in a bank (every
    state layer's tensors whole, as at TP 1), from vLLM's own model class
    (``get_mamba_state_shape_from_config`` / ``_dtype_from_config``, the
    shapes its ``MambaSpec`` is built from) and its count of state layers,
    before any worker starts: the recorder's estimate.  0 without recurrent
    state."""
    import copy
    import math

    import torch
    from vllm.model_executor.models import ModelRegistry

    model_config = vllm_config.model_config
    if not has_recurrent_state(model_config):
        return 0
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures, model_config)
    whole = copy.copy(vllm_config)  # the same engine at TP 1 and PP 1: whole tensors, every layer
    whole.parallel_config = parallel = copy.copy(vllm_config.parallel_config)
    parallel.tensor_parallel_size = parallel.pipeline_parallel_size = 1
    parallel.rank = 0
    shapes = model_cls.get_mamba_state_shape_from_config(whole)
    dtypes = model_cls.get_mamba_state_dtype_from_config(whole)
    per_layer = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(shapes, dtypes))
    # the state layers' block type as the model's config names it (Jamba, Granite: mamba; Qwen3-Next:
    # linear_attention; LFM2's short convolutions: conv)
    layers = max(model_config.get_num_layers_by_block_type(parallel, kind)
                 for kind in ("mamba", "linear_attention", "conv"))
    return layers * per_layer


def state_layouts(caches, specs, kv_cache_config, tp_size: int) -> dict:
    """Layer -> (group index, full state layout, the page's state alignment)
    of the state layers ``caches`` names (the ones a worker records), from
    their specs (this rank's shapes)."""
    index = {n: i for i, g in enumerate(kv_cache_config.kv_cache_groups) for n in g.layer_names}
    return {n: (index[n], state_layout(specs[n], tp_size), state_alignment(specs[n])) for n in caches}


@dataclass(frozen=True)
class ReplayedStates:
    """The state layers whose recorded states each fill writes."""

    pages: StatePages
    groups: Mapping[str, list[str]]  # group name -> its layers whose recorded state is replayed
    lengths: np.ndarray  # the bank's recorded length per sequence (verify: each state block's by the rule)


def replay_states(bank: "Bank", caches: Mapping[str, Any], facts: "LayerFacts") -> ReplayedStates | None:
    """The state layers the bank holds states of get them at every fill
    (None: no state layer's)."""
    names = [n for n in caches if n in bank.states]
    missing = sorted(set(caches) - set(names))
    if missing:
        logger.warning("KVFillConnector: %s holds no recorded state for %d state layers (%s...): they get the "
                       "zero state; record the bank again with this kvfill for exact replay", bank.source,
                       len(missing), missing[0])
    if not names:
        return None
    specs = facts.specs
    state_pages = StatePages({n: caches[n] for n in names},
                             {n: bank.state_pages(n, specs[n].shapes, specs[n].dtypes, state_alignment(specs[n]))
                              for n in names})
    state_groups: dict[str, list[str]] = {}
    for geo, g in zip(facts.planner.groups, facts.kv_cache_config.kv_cache_groups):
        layers = [n for n in g.layer_names if n in state_pages.states]
        if layers:
            state_groups[geo.name] = layers
    logger.info("KVFillConnector: replaying the recorded state of %d state layers", len(names))
    return ReplayedStates(state_pages, state_groups, np.asarray(bank.lengths))
