"""KVFillConnector: a drop-in for vLLM's DecodeBenchConnector backed by kvfill.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVFillConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"fill_std": 0.1}}'

(or ``"kv_connector_module_path": "kvfill.connector"`` without the plugin).
The class only answers vLLM's ``KVConnectorBase_V1`` interface and delegates:
the scheduler side to ``scheduler.KVFillScheduler``, the worker side to
``worker.KVFillWorker``; options are parsed once by ``options.FillOptions``.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Iterator

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .metadata import (
    KVFillBankHandshake, KVFillConnectorMetadata, KVFillPromMetrics, KVFillRecordHandshake, KVFillStats,
    check_bank_handshakes, check_record_handshakes,
)
from .options import FillOptions
from .ranks import worker_where
from .scheduler import KVFillScheduler
from .specs import filled_group_ids
from .versions import untested_vllm
from .worker import KVFillWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVFillConnector", "KVFillConnectorMetadata"]


class KVFillConnector(KVConnectorBase_V1, SupportsHMA):
    """A drop-in for DecodeBenchConnector: synthetic KV for decode benchmarks."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        _warn_if_untested_vllm()
        try:
            self.options = FillOptions.from_extra_config(vllm_config.kv_transfer_config.kv_connector_extra_config)
        except ValueError as exc:
            if role != KVConnectorRole.WORKER:
                raise
            # each node reads its own copy of the bank: say which worker of which node could not
            raise ValueError(f"{worker_where(vllm_config)}: {exc}") from None
        model_config = getattr(vllm_config, "model_config", None)
        self.options.check_max_model_len(int(getattr(model_config, "max_model_len", 0) or 0))
        self._filled_group_ids = filled_group_ids(kv_cache_config)
        self.scheduler: KVFillScheduler | None = None
        self.worker: KVFillWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = KVFillScheduler(vllm_config, kv_cache_config, self.options)
        elif role == KVConnectorRole.WORKER:
            self.worker = KVFillWorker(vllm_config, kv_cache_config, self.options)

    # ---------------------------------------------------------------- worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """The engine, its kernels compiled (``warmup``) and the startup fill:
        kvfill's own warm-up, inside ``jit_monitor_allowance`` where vLLM
        registers the caches after its JIT monitor is armed (vLLM 0.34's
        extensible KV cache: ``extend_kv_cache``)."""
        assert self.worker is not None
        with jit_monitor_allowance("registers the KV caches"):
            self.worker.register_kv_caches(kv_caches)

    def shutdown(self):
        """The worker's process ends: a recording worker's parts not fetched go."""
        if self.worker is not None and self.worker.recorder is not None:
            self.worker.recorder.drop()

    def get_handshake_metadata(self) -> KVFillBankHandshake | KVFillRecordHandshake | None:
        """Replay: the bank this worker loaded (node, ranks, path, identity);
        recording: the digest of its node's engine flags."""
        return self.worker.handshake if self.worker is not None else None

    # ---------------------------------------------------------------- scheduler
    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Every worker's handshake, at start: each replaying worker must have
        loaded the bank this scheduler indexed (``check_bank_handshakes``),
        each recording worker's node run the same engine flags
        (``check_record_handshakes``)."""
        if self.scheduler is not None and self.options.bank_index is not None:
            check_bank_handshakes(self.options.bank, self.options.bank_index.identity, metadata.values())
        if self.scheduler is not None and self.options.record_engine is not None:
            check_record_handshakes(self.options.record_engine, metadata.values(), self.options.record_flags or ())

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self.worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVFillConnectorMetadata), type(meta)
        self.worker.start_fill(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # the fill is stream-ordered before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self):
        """Record role only (``kvfill.record``): the step's forward has written
        the prompts' KV; read the completed ones."""
        if self.worker is not None and self.options.recording:
            meta = self._get_connector_metadata()
            assert isinstance(meta, KVFillConnectorMetadata), type(meta)
            self.worker.record(meta)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker's fill figures; the scheduler's wrapped positions (vLLM
        sums both sides' into one)."""
        side = self.worker if self.worker is not None else self.scheduler
        if side is None or side.stats.is_empty():
            return None
        stats, side.stats = side.stats, KVFillStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVFillStats(data=dict(data)) if data is not None else KVFillStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """Fill bytes, seconds, requests and fills as counters on the served /metrics."""
        return KVFillPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of a step whose fill was skipped (metadata that does not fit
        the caches): vLLM applies its ``kv_load_failure_policy`` to them
        instead of decoding over whatever the memory held."""
        return self.worker.take_failed_block_ids() if self.worker is not None else set()

    @property
    def requires_kv_delivery(self) -> bool:
        """False: kvfill hands no KV off, so a preempted request keeps its
        in-flight output (the default, true for kv_both, drops it for a
        hand-off that never happens)."""
        return False

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        """The groups kvfill writes: the request's own blocks in each group
        with per-layer cache views (circular buffers and bounded-replay
        windows included, not only the prefix-cacheable ones a hash-addressed
        store holds); raw groups it cannot address (HiSparse) are not loaded."""
        return self._filled_group_ids

    # ------------------------------------------------------------ sleep mode (vLLM 0.33)
    def unregister_kv_caches(self) -> None:
        """Sleep: the caches' memory is discarded; the engine keeps its tables
        (the memory returns at the same addresses on wake)."""
        return None

    def restore_kv_caches(self) -> None:
        """Wake: the memory is back, its contents lost - redo the startup fill."""
        if self.worker is not None:
            with jit_monitor_allowance("writes the startup fill again on wake"):
                self.worker.restore_kv_caches()

    # ------------------------------------------------------------ optional hooks (vLLM 0.34)
    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any):
        """In process: kvfill's workers write the caches with torch ops and
        Triton kernels in their own process, registering or exporting
        nothing, so the extensible KV cache may commit its pages as it likes."""
        from vllm.config.kv_transfer import KVCacheAccess

        return KVCacheAccess.IN_PROCESS

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """False: the scheduler side selects a request's blocks from its own
        tokens (``Planner.select``); it asks vLLM for no lookahead hashes."""
        return False

    def may_load_async(self, request: "Request") -> bool:
        """False: every fill is synchronous (``load_kv_async`` False), so vLLM
        starts it before the step's forward (``has_sync_kv_loads``) and never
        parks a request waiting for an in-flight load."""
        return False

    # ---------------------------------------------------------------- scheduler
    def on_new_request(self, request: "Request") -> None:
        """Before vLLM looks the request up in its prefix cache: its hashes
        salted by its kind, a malformed ``kvfill_prefill`` said, never raised
        (``KVFillScheduler.on_new_request``)."""
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        self.scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        self.scheduler.request_finished(request)
        return False, None


def _warn_if_untested_vllm() -> None:
    """Once per process: vLLM's version, when kvfill is not tested on it."""
    import vllm

    from .registration import logger

    warning = untested_vllm(getattr(vllm, "__version__", ""))
    if warning:
        logger.warning_once(warning)


# ---------------------------------------------------------------- vLLM's JIT monitor
# vLLM (0.32 and 0.34 alike) arms a kernel JIT monitor at the end of its
# warm-up (``vllm/utils/jit_monitor.py`` ``activate``, called by
# ``Worker._maybe_activate_jit_monitor`` at the end of
# ``compile_or_warm_up_model``): every Triton compile after it (its
# ``triton.knobs.runtime.jit_post_compile_hook``) is logged as "JIT
# compilation during inference", or raised under ``--jit-monitor-mode error``.
# vLLM 0.32, and 0.34 without the extensible KV cache, register the caches in
# ``initialize_from_config``, before that warm-up.  Under 0.34's extensible KV
# cache (CUDA's default) the worker creates the connector and registers the
# caches in ``extend_kv_cache``, after it, and a wake or a weight update that
# borrowed the cache's pages calls ``restore_kv_caches`` while serving: kvfill's
# own warm-up there - the compiles ``FillEngine.warmup`` makes so that no step
# compiles - would be reported as the latency spike it prevents.  The monitor
# has no pause or allow-list; every hook it installs reports through one
# function, ``_handle_jit_event``.  The allowance below puts a pass-through in
# its place while the connector registers or restores, which swallows only the
# reports made on that thread (or task) inside it; a monitor not armed yet
# needs none.
_ALLOWED: ContextVar[list | None] = ContextVar("kvfill_jit_monitor_allowance", default=None)
_ALLOWANCE_LOCK = threading.Lock()
_allowance_users = 0
MONITOR_MODULE = "vllm.utils.jit_monitor"


def _allowing(report):
    """``report`` (the monitor's ``_handle_jit_event``) for every compile
    except those made inside ``jit_monitor_allowance`` on this thread or
    task, which are only counted."""

    def handle_jit_event(*args, **kwargs):
        allowed = _ALLOWED.get()
        if allowed is None:
            return report(*args, **kwargs)
        allowed.append(str(kwargs.get("fn_name", "?")))
        return None

    handle_jit_event.kvfill_reports_to = report
    return handle_jit_event


@contextlib.contextmanager
def jit_monitor_allowance(what: str) -> Iterator[None]:
    """kvfill's warm-up while vLLM's JIT monitor is armed: its compiles are
    start-up, not inference, and are neither logged as such nor raised under
    ``--jit-monitor-mode error``; one info line counts them.  Where no monitor
    is armed (the caches registered before vLLM's warm-up ends) nothing
    changes.  Never imports the monitor: an armed one is imported already."""
    global _allowance_users
    monitor = sys.modules.get(MONITOR_MODULE)
    is_active = getattr(monitor, "is_active", None)
    if monitor is None or not callable(is_active) or not is_active():
        yield
        return
    from .registration import logger

    if not callable(getattr(monitor, "_handle_jit_event", None)):
        logger.warning_once("KVFillConnector %s after vLLM armed its JIT monitor, whose reports kvfill cannot "
                            "pass (no _handle_jit_event in this vLLM): its warm-up's kernel compiles may be "
                            "reported as compilations during inference, and refused under jit_monitor_mode "
                            "error", what)
        yield
        return
    with _ALLOWANCE_LOCK:
        if _allowance_users == 0:
            monitor._handle_jit_event = _allowing(monitor._handle_jit_event)
        _allowance_users += 1
    allowed: list[str] = []
    token = _ALLOWED.set(allowed)
    try:
        yield
    finally:
        _ALLOWED.reset(token)
        with _ALLOWANCE_LOCK:
            _allowance_users -= 1
            original = getattr(monitor._handle_jit_event, "kvfill_reports_to", None)
            if _allowance_users == 0 and original is not None:
                monitor._handle_jit_event = original
        if allowed:
            logger.info("KVFillConnector %s after vLLM armed its JIT monitor: %d kernel compilations of "
                        "kvfill's warm-up (%s) are start-up, not reported as compilations during inference",
                        what, len(allowed), ", ".join(sorted(set(allowed))))
