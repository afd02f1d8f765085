"""``KVFillWorker``, the worker side that vLLM's connector calls: one engine
over vLLM's caches, one fill per step; each call runs its steps in order,
their code in a file per role.

``register_kv_caches`` builds a ``FillEngine`` from the per-layer caches vLLM
registers (``registration.py``) and this rank's planner.  Replaying, the bank
is loaded once, there, onto the caches' device, with the state layers'
recorded states (``bank_loading.py``).  ``start_fill`` turns a step's
metadata into one ``Planner.plan`` and one ``FillEngine.fill`` for every
request, group and layer, stream-ordered, without a host sync; its state
blocks, skipped fills and ``verify`` are in ``step_fill.py``.  vLLM 0.33's
sleep mode discards the caches' memory and, on wake, calls
``restore_kv_caches`` (not ``register_kv_caches``): the startup fill is
written again there.  The record role's reads live in ``recorder.py``, the
process's ranks in ``ranks.py``.
"""
from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.logger import init_logger

from kvfill.bank import Bank, BankError
from kvfill.kernels import CacheGroup, FillEngine
from kvfill.kernels.state_pages import StatePages, StateWrite

from .bank_loading import load_rank_bank, replay_states
from .metadata import KVFillBankHandshake, KVFillConnectorMetadata, KVFillRecordHandshake, KVFillStats, rank_where
from .options import FillOptions
from .packed import (
    check_packed_rows, compressed_in_mixed_groups, left_out_line, packed_encoding, packed_row_kind, packed_views,
    refuse_layouts, unrecordable_line, zeroed_line,
)
from .planner import GroupKind, Planner
from .ranks import current_dcp_rank, current_pp_rank, current_tp_rank
from .recorder import Recorder
from .registration import CpuAttentionViews, cache_groups, group_mode, layer_ids, platform_is_cpu, with_cache_slots
from .rotary_source import rotary_table_bytes, worker_rotary
from .specs import (
    geometries_from_config, layer_encoding, layer_kv_geometry, layer_specs_by_name, spec_kind, startup_fill_group_ids,
    untransferred_layers,
)
from .states import state_layouts
from .step_fill import fill_requests, log_fill, state_blocks, state_rule_breaks, verify_fill

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Under "vllm." so that vLLM's logging configuration (handlers, level) applies.
logger = init_logger("vllm.kvfill.connector")


class KVFillWorker:
    """One worker process's fills (module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", options: FillOptions,
                 dcp_rank: int | None = None, tp_rank: int | None = None, pp_rank: int | None = None):
        """The ranks are vLLM's (its process groups) unless given."""
        self.options = options
        self.kv_cache_config = kv_cache_config
        self.dcp_rank = current_dcp_rank(vllm_config) if dcp_rank is None else dcp_rank
        # This rank's planner; register_kv_caches adds the caches' slots per block.
        self.planner = Planner(geometries_from_config(vllm_config, kv_cache_config),
                               granularity=options.granularity).for_rank(self.dcp_rank)
        self.startup_groups = startup_fill_group_ids(kv_cache_config) if options.startup_fill else set()
        self.cache_dtype = cache_dtype = vllm_config.cache_config.cache_dtype
        self.specs = specs = layer_specs_by_name(kv_cache_config)
        self.on_cpu = platform_is_cpu()
        model_config = getattr(vllm_config, "model_config", None)
        self.max_model_len = int(getattr(model_config, "max_model_len", 0) or 0)  # positions a request can have
        self.cpu_views = CpuAttentionViews(specs, cache_dtype)  # warns once of a CPU layout it does not know
        self.encodings = {name: layer_encoding(spec, cache_dtype) for name, spec in specs.items()}
        self.kv_geometry = {name: layer_kv_geometry(spec) for name, spec in specs.items()}
        # DeepSeek's sparse-attention rows (packed.py): per-token views, values their readers decode
        # (zero_packed: their tokens' bytes get zeros, as the in-tree connector writes)
        self.packed = {name: kind for name, spec in specs.items() if (kind := packed_row_kind(spec)) is not None}
        for name, kind in self.packed.items():
            self.encodings[name] = packed_encoding(kind, options.values, zero=options.zero_packed)
            self.kv_geometry[name] = None  # a packed row keeps its own order
        # Raw backing buffers laid out by the layer itself (HiSparse): no block dim to address.
        self.unaddressable = {name for name, spec in specs.items() if not getattr(spec, "has_layer_views", True)}
        # Groups vLLM keeps out of KV transfer (vLLM 0.34's HiSparse tiers): never filled, recorded or replayed.
        self.untransferred = untransferred_layers(kv_cache_config)
        refuse_layouts(specs, skip=self.untransferred)  # vLLM 0.34's head-major K/V slots: refused at start
        # compressed layers sharing a group with per-token ones: not fillable together, left out and named
        self.left_out = compressed_in_mixed_groups(kv_cache_config.kv_cache_groups, specs)
        self.engine: FillEngine | None = None
        self.stats = KVFillStats()
        self.last_stats = None  # FillStats of the latest fill
        self.failed_block_ids: set[int] = set()  # blocks of skipped fills, until vLLM asks
        kt = getattr(vllm_config, "kv_transfer_config", None)
        self.load_failure_policy = getattr(kt, "kv_load_failure_policy", "fail")
        self.vllm_config = vllm_config
        self.tp_rank = current_tp_rank(vllm_config) if tp_rank is None else tp_rank
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.pp_rank = current_pp_rank(vllm_config) if pp_rank is None else pp_rank
        # sent to the scheduler at start: the bank this worker loaded, or the recording's engine flags
        self.handshake: KVFillBankHandshake | KVFillRecordHandshake | None = None
        self.recorder = Recorder(options, vllm_config, self.tp_rank, self.pp_rank) if options.recording else None
        # Recurrent state (Mamba / linear attention layers): replayed from the bank's state section, recorded
        # into it (bank/state.py); the engine zeroes the groups whose state is not replayed.
        self.state_layers = {name for name, spec in specs.items() if spec_kind(spec) == GroupKind.MAMBA}
        self.state_pages: StatePages | None = None
        self.state_lengths = None  # the bank's recorded length per sequence, with state pages
        self.state_groups: dict[str, list[str]] = {}  # group name -> its layers whose recorded state is replayed

    # ------------------------------------------------------------ registration (registration.py)
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.options.recording:
            line = unrecordable_line(self.specs, self.encodings, self.left_out)
            if line:
                raise ValueError(line)
        if self.left_out:
            logger.warning(left_out_line(self.left_out))
        groups = cache_groups(kv_caches, self.planner.groups, self.kv_cache_config,
                              unaddressable=self.unaddressable | set(self.left_out) | set(self.untransferred),
                              encodings=self.encodings, kv_geometry=self.kv_geometry, mode=self._group_mode,
                              parts=self._views)
        asked = self.packed if self.options.zero_packed else {}  # zeros the user asked for are not named
        line = zeroed_line({n: s for n, s in self.specs.items() if n not in asked}, self.encodings)
        if line:
            logger.warning(line)
        state_caches = {n: kv_caches[n] for n in sorted(self.state_layers)
                        if isinstance(kv_caches.get(n), torch.Tensor) and n not in self.unaddressable
                        and n not in self.untransferred}
        _log_unfilled(self.unaddressable, self.untransferred)
        bank, placement = None, "device"
        node = socket.gethostname()  # how the handshake and errors name this worker's node
        if self.options.replay and not self.options.recording:
            bank, placement, groups = self._load_bank(groups, state_caches, node)
        if self.options.recording and self.options.record_engine is not None:
            self.handshake = KVFillRecordHandshake(node, self.tp_rank, self.pp_rank, self.options.record_engine,
                                                   self.options.record_flags or ())
        rotary = (worker_rotary(self.vllm_config, groups, self.kv_geometry, self.packed, bank.metadata)
                  if bank is not None and self.options.past_bank == "rotate" else None)
        self.engine = FillEngine(groups, values=self.options.values, backend=self.options.backend,
                                 layer_ids=layer_ids(kv_caches), bank=bank, bank_placement=placement,
                                 staging_bytes=self.options.staging_mib << 20, past_bank=self.options.past_bank,
                                 rotary=rotary,
                                 page_image_bytes=0 if self.options.recording else self.options.page_image_mib << 20)
        self.planner = with_cache_slots(self.planner, self.engine)
        if self.recorder is not None and state_caches:
            self.recorder.set_states(StatePages(state_caches),
                                     state_layouts(state_caches, self.specs, self.kv_cache_config, self.tp_size))
        # Compile the kernels (GPU) or write the page images of every position a
        # request can have (CPU) now, not in the first filling step.
        self.engine.warmup(self.max_model_len)
        logger.info("KVFillConnector: %s, %s backend, DCP rank %d, %d torch threads; caches:\n%s",
                    self.options.summary(), self.engine.backend, self.dcp_rank, torch.get_num_threads(),
                    self.engine.describe())
        self._startup_fill()

    def _group_mode(self, geo) -> str | None:
        """A group's fill mode (``registration.group_mode``)."""
        return group_mode(geo, self.options)

    def _views(self, name: str, cache: Any) -> Any:
        """A layer's cache as the engine takes it: a packed row's per-token
        views, vLLM CPU's K and V views, or the cache as registered."""
        if name in self.packed:
            return packed_views(self.packed[name], cache)
        return self.cpu_views.parts(name, cache) if self.on_cpu else cache

    def _load_bank(self, groups: dict[str, CacheGroup], state_caches: dict[str, torch.Tensor],
                   node: str) -> tuple[Bank, str, dict[str, CacheGroup]]:
        """Replaying: this rank's part of the bank and its state layers'
        recorded states (``bank_loading.py``), with the scheduler's handshake;
        ``(bank, where its rows are kept, the groups left to the engine)``."""
        try:
            rotate = self.options.past_bank == "rotate"  # its rotary tables on the device, counted by the fit
            bank, placement = load_rank_bank(self.options, groups, state_caches, self.vllm_config,
                                             self.kv_cache_config, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                             max_model_len=self.max_model_len,
                                             tables=rotary_table_bytes(self.max_model_len) if rotate else 0)
            if not self.options.zero_packed:
                check_packed_rows(bank, bank.part, self.packed)
            state_pages, state_groups, groups = replay_states(bank, state_caches, groups, self.specs,
                                                              self.planner.groups,
                                                              self.kv_cache_config.kv_cache_groups)
        except BankError as exc:  # missing, another version, lying: say which worker of which node
            raise BankError(f"{rank_where(node, self.tp_rank, self.pp_rank)}: {exc}") from None
        if state_pages is not None:
            self.state_pages = state_pages
            self.state_groups.update(state_groups)
            self.state_lengths = np.asarray(bank.lengths)  # verify: each state block's sequence by the rule
        # what this worker loaded, checked by the scheduler at start (vLLM's handshake)
        self.handshake = KVFillBankHandshake(node, self.tp_rank, self.pp_rank,
                                             os.path.abspath(self.options.bank), bank.identity or "")
        return bank, placement, groups

    def restore_kv_caches(self) -> None:
        """vLLM 0.33 sleep mode, on wake: the caches' memory is back at the
        same addresses, its contents lost - write the startup fill again.
        Requests' own blocks are filled when they are scheduled, as always."""
        if self.engine is not None:
            self._startup_fill()

    def _startup_fill(self) -> None:
        if not self.startup_groups:
            return
        names = [g.name for i, g in enumerate(self.planner.groups)
                 if i in self.startup_groups and g.name in self.engine.groups]
        stats = self.engine.fill_all(names)
        logger.info("KVFillConnector: startup fill of %d groups, %.1f MiB", len(names), stats.bytes / 2**20)

    # ------------------------------------------------------------ per step (step_fill.py)
    def start_fill(self, meta: KVFillConnectorMetadata) -> None:
        """One engine fill for every request of the step.

        Metadata this engine cannot apply (block ids past its caches, another
        group count: another engine configuration) writes nothing - the engine
        validates the whole plan before its first write - and the step's
        other requests are filled apart, the refused ones handed to vLLM's
        ``kv_load_failure_policy`` (``step_fill.fill_requests``).
        """
        self.last_stats = None
        if not meta:
            return
        if self.engine is None:
            raise RuntimeError("KVFillConnector: start_load_kv before register_kv_caches")
        t0 = time.perf_counter()
        done, failed = fill_requests(meta.request_selections(), self._fill, self.planner, self.load_failure_policy)
        self.failed_block_ids |= failed
        elapsed = time.perf_counter() - t0  # the step's fills, counted once (filled apart: one entry each)
        for i, (selections, plan, states, stats, written) in enumerate(done):
            self.last_stats = stats
            self.stats.record(len(selections), stats.entries, stats.bytes + written.bytes, elapsed if i == 0 else 0.0)
            log_fill(selections, stats, written, elapsed)
            if self.options.verify:
                breaks = state_rule_breaks(selections, self.planner, self.state_lengths) if states else []
                verify_fill(self.engine, plan, self.state_pages, states, self.stats, self.options.verify, breaks)

    def _fill(self, selections: list) -> tuple:
        """``selections`` planned and filled (their state blocks too), all
        checked before the first write: ``(plan, states, stats, written)``."""
        plan = self.planner.plan(selections, groups=self.engine.groups)
        states = state_blocks(self.planner, self.state_groups, selections)
        if states:
            self.state_pages.check(states)  # before the engine writes anything
        stats = self.engine.fill(plan)
        return plan, states, stats, self.state_pages.write(states) if states else StateWrite(0, 0, 0)

    def record(self, meta: KVFillConnectorMetadata) -> None:
        """Record role: after the forward, save the rows of the prompts the step completed."""
        self.recorder.save(self.engine, self.planner, meta)

    def take_failed_block_ids(self) -> set[int]:
        """The blocks of skipped fills since the last call (then forgotten)."""
        failed, self.failed_block_ids = self.failed_block_ids, set()
        return failed


def _log_unfilled(unaddressable: set[str], untransferred: dict[str, Any]) -> None:
    """The layers registration leaves unfilled, named at start."""
    if unaddressable:
        logger.warning("KVFillConnector: %d layers keep raw caches with no block views (%s...); they are not filled",
                       len(unaddressable), sorted(unaddressable)[0])
    if untransferred:
        logger.info("KVFillConnector: %d layers of groups %s are kept out of KV transfer by vLLM "
                    "(enable_kv_transfer False); they are not filled, recorded or replayed (%s...)",
                    len(untransferred), sorted(set(untransferred.values())), sorted(untransferred)[0])
