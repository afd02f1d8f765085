"""Worker side of KVFillConnector: one engine over vLLM's caches, one fill per step.

``register_kv_caches`` builds a ``FillEngine`` from the per-layer caches vLLM
registers and this rank's planner; ``start_fill`` turns a step's metadata
into one ``Planner.plan`` and one ``FillEngine.fill`` for every request,
group and layer, stream-ordered, without a host sync.  Replaying, the bank is
loaded once, at registration, onto the caches' device (``bank_checks.py``).
vLLM 0.33's sleep mode discards the caches' memory and, on wake, calls
``restore_kv_caches`` (not ``register_kv_caches``): the startup fill is
written again there.  The record role's reads live in ``recorder.py``.
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

from kvfill.bank import BankError
from kvfill.kernels import CacheGroup, FillEngine, FillPlan
from kvfill.kernels.state_pages import StatePages

from .bank_checks import load_bank, rank_part
from .cpu_layout import cpu_attention_parts
from .metadata import KVFillBankHandshake, KVFillConnectorMetadata, KVFillRecordHandshake, KVFillStats, rank_where
from .options import FillOptions
from .planner import RECORDED_KINDS, GroupKind, Planner
from .recorder import Recorder
from .specs import (
    geometries_from_config, layer_encoding, layer_kv_geometry, layer_specs_by_name, spec_kind, startup_fill_group_ids,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# Under "vllm." so that vLLM's logging configuration (handlers, level) applies.
logger = init_logger("vllm.kvfill.connector")


def current_tp_rank(vllm_config: "VllmConfig") -> int:
    """This process's tensor parallel rank (0 without TP)."""
    if vllm_config.parallel_config.tensor_parallel_size <= 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def worker_where(vllm_config: "VllmConfig") -> str:
    """``node HOST, TP rank r, PP rank p`` of this worker process."""
    return rank_where(socket.gethostname(), current_tp_rank(vllm_config), current_pp_rank(vllm_config))


def current_pp_rank(vllm_config: "VllmConfig") -> int:
    """This process's pipeline parallel rank (0 without PP)."""
    if getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) <= 1:
        return 0
    from vllm.distributed.parallel_state import get_pp_group

    return get_pp_group().rank_in_group


def current_dcp_rank(vllm_config: "VllmConfig") -> int:
    """This process's rank in its DCP group (0 without DCP)."""
    if vllm_config.parallel_config.decode_context_parallel_size <= 1:
        return 0
    from vllm.distributed.parallel_state import get_dcp_group

    return get_dcp_group().rank_in_group


class KVFillWorker:
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
        self.on_cpu = _platform_is_cpu()
        model_config = getattr(vllm_config, "model_config", None)
        self.max_model_len = int(getattr(model_config, "max_model_len", 0) or 0)  # positions a request can have
        self.cpu_layout_warned = False
        self.encodings = {name: layer_encoding(spec, cache_dtype) for name, spec in specs.items()}
        self.kv_geometry = {name: layer_kv_geometry(spec) for name, spec in specs.items()}
        # Raw backing buffers laid out by the layer itself (HiSparse): no block dim to address.
        self.unaddressable = {name for name, spec in specs.items() if not getattr(spec, "has_layer_views", True)}
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
        self.state_groups: dict[str, list[str]] = {}  # group name -> its layers whose recorded state is replayed

    # ------------------------------------------------------------ registration
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        groups = self._cache_groups(kv_caches)
        state_caches = {n: kv_caches[n] for n in sorted(self.state_layers)
                        if isinstance(kv_caches.get(n), torch.Tensor) and n not in self.unaddressable}
        if self.unaddressable:
            logger.warning(
                "KVFillConnector: %d layers keep raw caches with no block views (%s...); they are not filled",
                len(self.unaddressable), sorted(self.unaddressable)[0],
            )
        bank = None
        node = socket.gethostname()  # how the handshake and errors name this worker's node
        if self.options.replay and not self.options.recording:
            # This rank's part only: its KV heads, its stage's layers, its DCP positions below max_model_len.
            part = rank_part(groups, self.tp_rank, self.tp_size, self.max_model_len or None)
            part = replace(part, layers=part.layers | frozenset(state_caches))  # and its state layers' states
            try:
                bank = load_bank(self.options.bank, part, self.vllm_config, device=_cache_device(groups))
                groups = self._replay_states(bank, state_caches, groups)
            except BankError as exc:  # missing, another version, lying: say which worker of which node
                raise BankError(f"{rank_where(node, self.tp_rank, self.pp_rank)}: {exc}") from None
            # what this worker loaded, checked by the scheduler at start (vLLM's handshake)
            self.handshake = KVFillBankHandshake(node, self.tp_rank, self.pp_rank,
                                                 os.path.abspath(self.options.bank), bank.identity or "")
        if self.options.recording and self.options.record_engine is not None:
            self.handshake = KVFillRecordHandshake(node, self.tp_rank, self.pp_rank, self.options.record_engine)
        self.engine = FillEngine(groups, values=self.options.values, backend=self.options.backend,
                                 layer_ids=_layer_ids(kv_caches), bank=bank,
                                 page_image_bytes=0 if self.options.recording else self.options.page_image_mib << 20)
        self.planner = _with_cache_slots(self.planner, self.engine)
        if self.recorder is not None and state_caches:
            self.recorder.set_states(StatePages(state_caches), self._state_layouts(state_caches))
        # Compile the kernels (GPU) or write the page images of every position a
        # request can have (CPU) now, not in the first filling step.
        self.engine.warmup(self.max_model_len)
        logger.info("KVFillConnector: %s, %s backend, DCP rank %d, %d torch threads; caches:\n%s",
                    self.options.summary(), self.engine.backend, self.dcp_rank, torch.get_num_threads(),
                    self.engine.describe())
        self._startup_fill()

    def _state_layouts(self, caches) -> dict:
        """Layer -> (group index, full state layout) of the state layers recorded."""
        from .states import state_layout

        index = {n: i for i, g in enumerate(self.kv_cache_config.kv_cache_groups) for n in g.layer_names}
        return {n: (index[n], state_layout(self.specs[n], self.tp_size)) for n in caches}

    def _replay_states(self, bank, caches, groups: dict[str, CacheGroup]) -> dict[str, CacheGroup]:
        """The state layers the bank holds states of get them at every fill
        (``StatePages``); the groups left to the engine (a group whose every
        layer's state is replayed is not registered there)."""
        names = [n for n in caches if n in bank.states]
        missing = sorted(set(caches) - set(names))
        if missing:
            logger.warning("KVFillConnector: %s holds no recorded state for %d state layers (%s...): they get the "
                           "zero state; record the bank again with this kvfill for exact replay", bank.source,
                           len(missing), missing[0])
        if not names:
            return groups
        self.state_pages = StatePages({n: caches[n] for n in names},
                                      {n: bank.state_pages(n, self.specs[n].shapes, self.specs[n].dtypes)
                                       for n in names})
        for geo, g in zip(self.planner.groups, self.kv_cache_config.kv_cache_groups):
            layers = [n for n in g.layer_names if n in self.state_pages.states]
            if layers:
                self.state_groups[geo.name] = layers
        logger.info("KVFillConnector: replaying the recorded state of %d state layers", len(names))
        return {name: g for name, g in groups.items()
                if name not in self.state_groups or set(g.layers) - set(self.state_groups[name])}

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

    def _cache_groups(self, kv_caches: dict[str, Any]) -> dict[str, CacheGroup]:
        """One engine group per KV cache group with addressable caches here.

        Layers of one group sharing one cache tensor are filled once.  Groups
        may alias one buffer (hybrid models): each still fills its own blocks.
        """
        groups: dict[str, CacheGroup] = {}
        for geo, g in zip(self.planner.groups, self.kv_cache_config.kv_cache_groups):
            layers, seen = {}, set()
            for name in g.layer_names:
                cache = kv_caches.get(name)
                if cache is None or name in self.unaddressable:
                    continue
                tensors = cache if isinstance(cache, (list, tuple)) else [cache]
                key = tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors)
                if key not in seen:
                    seen.add(key)
                    layers[name] = self._cpu_kv_parts(name, cache) if self.on_cpu else cache
            if layers:
                groups[geo.name] = CacheGroup(
                    layers,
                    num_blocks=self.kv_cache_config.num_blocks,
                    encoding={n: self.encodings.get(n, "auto") for n in layers},
                    mode=self._group_mode(geo),
                    dcp=geo.dcp,
                    kv={n: self.kv_geometry.get(n) for n in layers},
                )
        return groups

    def _group_mode(self, geo) -> str | None:
        """None: the engine's mode. Replaying, groups the recorder does not
        record get zeros (recurrent state: the empty state) or, for chunked
        local and cross attention, the synthetic fill of fill_mean/fill_std."""
        if geo.zero:
            return "zero"
        if not self.options.replay or geo.kind in RECORDED_KINDS:
            return None
        if geo.kind == GroupKind.MAMBA:
            return "zero"
        logger.info("KVFillConnector: group %s (%s) is not recorded in banks; it gets the synthetic %s fill",
                    geo.name, geo.kind.value, self.options.values.mode)
        return self.options.values.mode

    def _cpu_kv_parts(self, name: str, cache: Any) -> Any:
        """vLLM CPU attention caches as their K and V views (``cpu_layout.py``); one warning if not."""
        parts, ok = cpu_attention_parts(cache, self.specs.get(name), self.cache_dtype)
        if not ok and not self.cpu_layout_warned:
            self.cpu_layout_warned = True
            logger.warning("KVFillConnector: the CPU attention cache of %s (kv cache dtype %s) is not the "
                           "K-transposed layout kvfill knows; it is filled as registered, so token-granular and "
                           "replay fills do not put each token's K and V at its slot", name, self.cache_dtype)
        return parts

    # ------------------------------------------------------------ per step
    def start_fill(self, meta: KVFillConnectorMetadata) -> None:
        """One engine fill for every request of the step.

        Metadata this engine cannot apply (block ids past its caches, another
        group count: another engine configuration) writes nothing - the engine
        validates the whole plan before its first write - and is handed to
        vLLM's ``kv_load_failure_policy`` (``_skipped``).
        """
        self.last_stats = None
        if not meta:
            return
        if self.engine is None:
            raise RuntimeError("KVFillConnector: start_load_kv before register_kv_caches")
        t0 = time.perf_counter()
        selections = meta.request_selections()
        try:
            plan = self.planner.plan(selections, groups=self.engine.groups)
            states = self._state_blocks(selections)
            if states:
                self.state_pages.check(states)  # before the engine writes anything
            stats = self.last_stats = self.engine.fill(plan)
            if states:
                self.state_pages.write(states)
        except ValueError as exc:
            self._skipped(selections, exc)
            return
        elapsed = time.perf_counter() - t0
        self.stats.record(len(selections), stats.entries, stats.bytes, elapsed)
        logger.debug(
            "KVFillConnector: filled %d requests, %d block entries, %.2f MiB in %d launches, %.3f ms host",
            len(selections), stats.entries, stats.bytes / 2**20, stats.launches, elapsed * 1e3,
        )
        if self.options.verify:
            self._verify(plan, states)

    def _state_blocks(self, selections) -> dict:
        """Layer -> (state block ids, the sequences they replay) of the step's
        requests: each request's state block gets the state of the sequence
        its last filled block replays (``Planner.plan`` of the state groups)."""
        if not self.state_groups:
            return {}
        plan = self.planner.plan(selections, groups=self.state_groups)
        return {layer: (e.block_ids, e.sequence) for g, e in plan.groups.items() for layer in self.state_groups[g]}

    def record(self, meta: KVFillConnectorMetadata) -> None:
        """Record role: after the forward, save the rows of the prompts the step completed."""
        self.recorder.save(self.engine, self.planner, meta)

    def _skipped(self, selections, exc: ValueError) -> None:
        """A step's fill was skipped: tell vLLM, which applies ``kv_load_failure_policy``.

        vLLM 0.32 takes block-level load failures only with one KV cache group
        (block ids are per group); with several, ``fail`` fails loudly here and
        ``recompute`` can only log: the step decodes over unfilled blocks.
        """
        if len(self.planner.groups) == 1:
            failed = {int(b) for sel in selections for g in sel.groups for b in g.block_ids}
            failed.discard(self.planner.null_block_id)
            self.failed_block_ids |= failed
            logger.error("KVFillConnector: skipped this step's fill (%d blocks reported as load errors), its "
                         "metadata does not fit the caches: %s", len(failed), exc)
            return
        msg = (f"KVFillConnector: this step's fill does not fit the caches ({exc}); with "
               f"{len(self.planner.groups)} KV cache groups vLLM cannot take block-level load failures")
        if self.load_failure_policy == "fail":
            raise RuntimeError(msg + " (kv_load_failure_policy 'fail')") from exc
        logger.error("%s; kv_load_failure_policy %r: the step decodes over unfilled blocks", msg,
                     self.load_failure_policy)

    def take_failed_block_ids(self) -> set[int]:
        """The blocks of skipped fills since the last call (then forgotten)."""
        failed, self.failed_block_ids = self.failed_block_ids, set()
        return failed

    def _verify(self, plan: FillPlan, states: dict | None = None) -> None:
        report = self.engine.verify(plan)
        pages, bad_pages, first_pages = self.state_pages.mismatches(states) if states else (0, 0, [])
        self.stats.record_verify(report.num_mismatched + bad_pages)
        if report.ok and not bad_pages:
            logger.debug("KVFillConnector: verified %d elements and %d state pages", report.num_checked, pages)
            return
        state = f" and {bad_pages} of {pages} state pages" if pages else ""
        msg = (f"KVFillConnector: verify found {report.num_mismatched} of {report.num_checked} "
               f"elements{state} mismatched after the fill, first: {(report.first or first_pages)[:3]}")
        if self.options.verify == "raise":
            raise RuntimeError(msg)
        logger.error(msg)


def _with_cache_slots(planner: Planner, engine: FillEngine) -> Planner:
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


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _layer_ids(kv_caches: dict[str, Any]) -> dict[str, int]:
    """Layer index for the value function: the number in the layer name
    (``model.layers.7.self_attn.attn`` -> 7), registration order otherwise."""
    from vllm.model_executor.models.utils import extract_layer_index

    out = {}
    for i, name in enumerate(kv_caches):
        try:
            out[name] = extract_layer_index(name)
        except (AssertionError, ValueError):
            out[name] = i
    if len(set(out.values())) != len(out):  # names without unique indices
        out = {name: i for i, name in enumerate(kv_caches)}
    return out


def _cache_device(groups: dict[str, CacheGroup]) -> torch.device:
    for g in groups.values():
        for cache in g.layers.values():
            return (cache[0] if isinstance(cache, (list, tuple)) else cache).device
    return torch.device("cpu")
