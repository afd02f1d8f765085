"""What a replaying worker loads when vLLM registers its caches
(``load_replay``, called by ``registration.register``): this rank's part of
the bank - its KV heads, its stage's layers and state layers, its DCP
positions below ``max_model_len`` - on the caches' device or, where it does
not fit there or is asked to, in host memory (loaded, placed and checked by
``bank_checks.py``), the state layers whose recorded states the bank holds,
written into each request's state block at every fill (``StatePages``), the
rotary layers ``past_bank: "rotate"`` turns, and the handshake the scheduler
checks.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping

import torch
from vllm.logger import init_logger

from kvfill.bank import Bank, BankError
from kvfill.kernels import CacheGroup

from .bank_checks import load_bank, rank_part
from .layer_facts import LayerFacts
from .metadata import KVFillBankHandshake, rank_where
from .options import FillOptions
from .packed import check_packed_rows
from .rotary_source import rotary_table_bytes, worker_rotary
from .states import ReplayedStates, replay_states

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Under "vllm." so that vLLM's logging configuration (handlers, level) applies.
logger = init_logger("vllm.kvfill.connector")


@dataclass(frozen=True)
class Replay:
    """What ``load_replay`` loaded for this worker (module docstring)."""

    bank: Bank
    placement: str  # where the fill keeps the rows: "device" or "host"
    groups: dict[str, CacheGroup]  # the groups left to the engine (a wholly state-replayed one is not)
    states: ReplayedStates | None
    rotary: dict | None  # past_bank "rotate": layer -> its Rotary
    handshake: KVFillBankHandshake  # what this worker loaded, checked by the scheduler at start


def load_replay(options: FillOptions, facts: LayerFacts, groups: dict[str, CacheGroup],
                state_caches: Mapping[str, Any], vllm_config: "VllmConfig") -> Replay:
    """This worker's replay (module docstring); a bank missing, of another
    version or lying refused naming this worker and its node."""
    node = socket.gethostname()
    ranks = facts.ranks
    rotate = options.past_bank == "rotate"  # its rotary tables on the device, counted by the fit
    device = cache_device(groups)
    try:
        bank, placement = load_rank_bank(options, facts, groups, state_caches, vllm_config, device,
                                         tables=rotary_table_bytes(facts.max_model_len) if rotate else 0)
        if not options.zero_packed:
            check_packed_rows(bank, bank.part, facts.packed)
        rotary = worker_rotary(vllm_config, groups, facts.kv_geometry, facts.packed, bank.metadata) \
            if rotate else None
        states = replay_states(bank, state_caches, facts)
    except BankError as exc:  # missing, another version, lying: say which worker of which node
        raise BankError(f"{rank_where(node, ranks.tp, ranks.pp)}: {exc}") from None
    if states is not None:  # a group whose every layer's recorded state is replayed is not the engine's
        groups = {name: g for name, g in groups.items()
                  if name not in states.groups or set(g.layers) - set(states.groups[name])}
    handshake = KVFillBankHandshake(node, ranks.tp, ranks.pp, os.path.abspath(options.bank), bank.identity or "")
    return Replay(bank, placement, groups, states, rotary, handshake)


def load_rank_bank(options: FillOptions, facts: LayerFacts, groups: dict[str, CacheGroup],
                   state_caches: Mapping[str, Any], vllm_config: "VllmConfig", device: torch.device, *,
                   tables: int = 0) -> tuple[Bank, str]:
    """This rank's part of the bank ``options.bank`` and where the fill keeps
    its rows (``options.bank_placement``, ``staging_mib``:
    ``bank_checks.load_bank``; ``tables``: bytes of the rotary cos/sin
    tables ``past_bank: "rotate"`` keeps on the device, counted in every
    placement)."""
    # This rank's part only: its KV heads, its stage's layers, its DCP positions below max_model_len.
    part = rank_part(groups, facts.ranks.tp, facts.ranks.tp_size, facts.max_model_len or None)
    part = replace(part, layers=part.layers | frozenset(state_caches))  # and its state layers' states
    outside = caches_outside_torch(vllm_config, facts.kv_cache_config)
    return load_bank(options.bank, part, vllm_config, device=device, placement=options.bank_placement,
                     staging_bytes=options.staging_mib << 20, rotate=options.past_bank == "rotate",
                     caches_outside_torch=outside, tables=tables)


def cache_device(groups: dict[str, CacheGroup]) -> torch.device:
    """The device of the registered caches."""
    for g in groups.values():
        for cache in g.layers.values():
            return (cache[0] if isinstance(cache, (list, tuple)) else cache).device
    return torch.device("cpu")


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
