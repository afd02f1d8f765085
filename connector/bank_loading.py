"""What a replaying worker loads when vLLM registers its caches: this rank's
part of the bank - its KV heads, its stage's layers and state layers, its DCP
positions below ``max_model_len`` - on the caches' device or, where it does
not fit there or is asked to, in host memory (loaded, placed and checked by
``bank_checks.py``), and the state layers whose recorded states the bank
holds, written into each request's state block at every fill
(``StatePages``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping

from vllm.logger import init_logger

from kvfill.bank import Bank
from kvfill.kernels import CacheGroup
from kvfill.kernels.state_pages import StatePages

from .bank_checks import load_bank, rank_part
from .registration import cache_device
from .states import state_alignment

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Under "vllm." so that vLLM's logging configuration (handlers, level) applies.
logger = init_logger("vllm.kvfill.connector")


def load_rank_bank(options, groups: dict[str, CacheGroup], state_caches: Mapping[str, Any],
                   vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", *, tp_rank: int, tp_size: int,
                   max_model_len: int, tables: int = 0) -> tuple[Bank, str]:
    """This rank's part of the bank ``options.bank`` and where the fill keeps
    its rows (``options.bank_placement``, ``staging_mib``:
    ``bank_checks.load_bank``; ``max_model_len`` 0: every recorded position;
    ``tables``: bytes of the rotary cos/sin tables ``past_bank: "rotate"``
    keeps on the device, counted in every placement)."""
    # This rank's part only: its KV heads, its stage's layers, its DCP positions below max_model_len.
    part = rank_part(groups, tp_rank, tp_size, max_model_len or None)
    part = replace(part, layers=part.layers | frozenset(state_caches))  # and its state layers' states
    outside = caches_outside_torch(vllm_config, kv_cache_config)
    return load_bank(options.bank, part, vllm_config, device=cache_device(groups), placement=options.bank_placement,
                     staging_bytes=options.staging_mib << 20, rotate=options.past_bank == "rotate",
                     caches_outside_torch=outside, tables=tables)


def caches_outside_torch(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> int:
    """Bytes of vLLM's KV cache that torch's allocator does not hold: vLLM
    0.34's extensible KV cache (CUDA's default) maps its own device memory,
    sized from what is free after warmup, and creates the connector
    afterwards; its bytes are vLLM's as much as the weights torch holds.
    Every device tensor of the connector's ``kv_cache_config`` then names
    the one committed allocation (``committed_kv_cache_tensors``): counted
    once.  0 where the cache is torch's (vLLM 0.32 and 0.33, or it is off)."""
    if not getattr(vllm_config.cache_config, "enable_extensible_kv_cache", False):
        return 0
    return max((int(t.size) for t in kv_cache_config.kv_cache_tensors if not getattr(t, "host_resident", False)),
               default=0)


def replay_states(bank: Bank, caches: Mapping[str, Any], groups: dict[str, CacheGroup], specs: Mapping[str, Any],
                  planner_groups, kv_cache_groups) -> tuple[StatePages | None, dict[str, list[str]],
                                                            dict[str, CacheGroup]]:
    """The state layers the bank holds states of get them at every fill
    (``StatePages``, None: no state layer's); which layers of each group
    (group name -> its layers whose recorded state is replayed); the groups
    left to the engine (a group whose every layer's state is replayed is not
    registered there)."""
    names = [n for n in caches if n in bank.states]
    missing = sorted(set(caches) - set(names))
    if missing:
        logger.warning("KVFillConnector: %s holds no recorded state for %d state layers (%s...): they get the "
                       "zero state; record the bank again with this kvfill for exact replay", bank.source,
                       len(missing), missing[0])
    if not names:
        return None, {}, groups
    state_pages = StatePages({n: caches[n] for n in names},
                             {n: bank.state_pages(n, specs[n].shapes, specs[n].dtypes, state_alignment(specs[n]))
                              for n in names})
    state_groups: dict[str, list[str]] = {}
    for geo, g in zip(planner_groups, kv_cache_groups):
        layers = [n for n in g.layer_names if n in state_pages.states]
        if layers:
            state_groups[geo.name] = layers
    logger.info("KVFillConnector: replaying the recorded state of %d state layers", len(names))
    return state_pages, state_groups, {name: g for name, g in groups.items()
                                       if name not in state_groups or set(g.layers) - set(state_groups[name])}
