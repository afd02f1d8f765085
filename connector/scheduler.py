"""Scheduler side of KVFillConnector: which requests to fill, and their blocks.

Every new request's prompt minus its last token is reported as external; once
vLLM has allocated its blocks, the planner selects the external blocks of
every group (again after a preemption, unless ``refill_on_preemption`` is
off, so a preempted request is not prefilled for real).  The step's
selections travel to the workers as ``KVFillConnectorMetadata``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .metadata import KVFillConnectorMetadata
from .options import FillOptions
from .planner import Planner, RequestSelection
from .specs import geometries_from_config, select_request, startup_fill_group_ids

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class KVFillScheduler:
    def __init__(self, vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", options: FillOptions):
        self.options = options
        self.planner = Planner(geometries_from_config(vllm_config, kv_cache_config),
                               granularity=options.granularity)
        self.startup_groups = startup_fill_group_ids(kv_cache_config) if options.startup_fill else set()
        # request id -> its num_preemptions when it was filled
        self.filled: dict[str, int] = {}
        # request id -> the locally computed tokens it was last asked about: the
        # grant starts there even when the scheduler trims its end
        self.asked: dict[str, int] = {}
        self.pending: dict[str, RequestSelection] = {}

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        preemptions = getattr(request, "num_preemptions", 0)
        seen = self.filled.get(request.request_id)
        if seen is not None and not (self.options.refill_on_preemption and preemptions > seen):
            return 0, False
        self.asked[request.request_id] = num_computed_tokens
        return max(0, request.num_tokens - num_computed_tokens - 1), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        num_local = self.asked.pop(request.request_id, None)
        # Handled from here on, even with nothing to fill (a 1-token prompt, a
        # full local prefix hit): after a preemption its generated tokens are
        # not a prompt to fill unless refill_on_preemption says so (vLLM #57419).
        self.filled[request.request_id] = getattr(request, "num_preemptions", 0)
        if num_external_tokens == 0:
            return
        if num_local is not None and num_local + num_external_tokens > request.num_tokens - 1:
            num_local = None  # not the query this grant answers: fall back to the tail
        # Startup-filled groups are skipped before planning: their tables are
        # never looked at, so a table shorter than the prompt cannot raise.
        sel = select_request(self.planner, request, blocks, num_external_tokens, num_local,
                             skip_groups=self.startup_groups)
        if any(len(g.block_ids) for g in sel.groups):
            self.pending[request.request_id] = sel

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVFillConnectorMetadata:
        meta = KVFillConnectorMetadata(selections=self.pending, null_block_id=self.planner.null_block_id)
        self.pending = {}
        return meta

    def request_finished(self, request: "Request") -> None:
        self.filled.pop(request.request_id, None)
        self.asked.pop(request.request_id, None)
        self.pending.pop(request.request_id, None)
