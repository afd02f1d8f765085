"""``KVFillWorker``, the worker side that vLLM's connector calls: one engine
over vLLM's caches, one fill per step; each call runs its steps in order,
their code in a file per role.

Made, it reads the configs' facts about its layers once
(``layer_facts.py``); ``register_kv_caches`` turns the caches vLLM
registers into one immutable ``Registration`` and the ``FillEngine`` built
from it (``registration.py``: views, groups, the bank, states, rotary
layers, warm-up and the startup fill).  ``start_fill`` turns a step's
metadata into one ``Planner.plan`` and one ``FillEngine.fill`` for every
request, group and layer, stream-ordered, without a host sync; its state
blocks, skipped fills and ``verify`` are in ``step_fill.py``.  vLLM 0.33's
sleep mode discards the caches' memory and, on wake, calls
``restore_kv_caches`` (not ``register_kv_caches``): the registration's
startup fill is written again there.  The record role's reads live in
``recorder.py``, the process's ranks in ``ranks.py``.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvfill.kernels import FillEngine
from kvfill.kernels.state_pages import StateWrite

from .layer_facts import LayerFacts, Ranks, read_layer_facts
from .metadata import KVFillBankHandshake, KVFillConnectorMetadata, KVFillRecordHandshake, KVFillStats
from .options import FillOptions
from .ranks import current_dcp_rank, current_pp_rank, current_tp_rank
from .recorder import Recorder
from .registration import Registration, register, startup_fill
from .step_fill import fill_requests, log_fill, state_blocks, verify_fill

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class KVFillWorker:
    """One worker process's fills (module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", options: FillOptions,
                 dcp_rank: int | None = None, tp_rank: int | None = None, pp_rank: int | None = None):
        """The ranks are vLLM's (its process groups) unless given."""
        self.options = options
        self.vllm_config = vllm_config
        ranks = Ranks(tp=current_tp_rank(vllm_config) if tp_rank is None else tp_rank,
                      tp_size=vllm_config.parallel_config.tensor_parallel_size,
                      pp=current_pp_rank(vllm_config) if pp_rank is None else pp_rank,
                      dcp=current_dcp_rank(vllm_config) if dcp_rank is None else dcp_rank)
        self.facts: LayerFacts = read_layer_facts(vllm_config, kv_cache_config, options, ranks)
        self.registration: Registration | None = None  # register_kv_caches
        self.engine: FillEngine | None = None
        self.stats = KVFillStats()
        self.last_stats = None  # FillStats of the latest fill
        self.failed_block_ids: set[int] = set()  # blocks of skipped fills, until vLLM asks
        kt = getattr(vllm_config, "kv_transfer_config", None)
        self.load_failure_policy = getattr(kt, "kv_load_failure_policy", "fail")
        self.recorder = Recorder(options, vllm_config, ranks.tp, ranks.pp) if options.recording else None

    @property
    def handshake(self) -> KVFillBankHandshake | KVFillRecordHandshake | None:
        """Sent to the scheduler at start: the bank this worker loaded, or the recording's engine flags."""
        return self.registration.handshake if self.registration is not None else None

    # ------------------------------------------------------------ registration (registration.py)
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.registration, self.engine = register(self.facts, kv_caches, self.options, self.vllm_config)

    def restore_kv_caches(self) -> None:
        """vLLM 0.33 sleep mode, on wake: the caches' memory is back at the
        same addresses, its contents lost - write the startup fill again.
        Requests' own blocks are filled when they are scheduled, as always."""
        if self.registration is not None:
            startup_fill(self.registration, self.engine)

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
        reg = self.registration
        t0 = time.perf_counter()
        done, failed = fill_requests(meta.request_selections(), self._fill, reg.planner, self.load_failure_policy)
        self.failed_block_ids |= failed
        elapsed = time.perf_counter() - t0  # the step's fills, counted once (filled apart: one entry each)
        for i, (selections, plan, states, stats, written) in enumerate(done):
            self.last_stats = stats
            self.stats.record(len(selections), stats.entries, stats.bytes + written.bytes, elapsed if i == 0 else 0.0)
            log_fill(selections, stats, written, elapsed)
            if self.options.verify:
                verify_fill(reg, self.engine, selections, plan, states, self.stats, self.options.verify)

    def _fill(self, selections: list) -> tuple:
        """``selections`` planned and filled (their state blocks too), all
        checked before the first write: ``(plan, states, stats, written)``."""
        reg = self.registration
        plan = reg.planner.plan(selections, groups=self.engine.groups)
        states = state_blocks(reg, selections)
        if states:
            reg.replayed.pages.check(states)  # before the engine writes anything
        stats = self.engine.fill(plan)
        return plan, states, stats, reg.replayed.pages.write(states) if states else StateWrite(0, 0, 0)

    def record(self, meta: KVFillConnectorMetadata) -> None:
        """Record role: after the forward, save the rows of the prompts the step completed."""
        self.recorder.save(self.registration, self.engine, meta)

    def take_failed_block_ids(self) -> set[int]:
        """The blocks of skipped fills since the last call (then forgotten)."""
        failed, self.failed_block_ids = self.failed_block_ids, set()
        return failed

