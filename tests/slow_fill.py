"""A KVFillConnector that sleeps in its scheduler's steps, for kvfill-check's
timing tests (tests/test_check_timing.py), loaded by vLLM through
``kv_connector_module_path``.  Set in the engine process's environment
(KVFillConnector refuses keys it does not know in its extra config):

  * ``SLOW_FILL_DELAY_MS``: the sleep, in every step that schedules a
    filled request (not one asking for real prefill) after the engine's
    first batch (the check's untimed greedy pass) - a fill that slows
    decode;
  * ``SLOW_FILL_BURST_BATCH`` and ``SLOW_FILL_PROMPTS``: the sleep instead
    only in steps of the N-th batch of requests the engine got
    (``SLOW_FILL_PROMPTS`` requests each, counted from 0), whatever their
    kind - a burst of load on the host during one pass.
"""
from __future__ import annotations

import os
import time

from kvfill.connector import KVFillConnector
from kvfill.connector.request_params import PREFILL_PARAM


class SlowFillConnector(KVFillConnector):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self.test_delay_s = float(os.environ.get("SLOW_FILL_DELAY_MS", 0)) / 1e3
        burst = os.environ.get("SLOW_FILL_BURST_BATCH")
        self.test_burst_batch = int(burst) if burst else None
        self.test_prompts = int(os.environ.get("SLOW_FILL_PROMPTS", 1))
        self.test_batch: dict[str, int] = {}  # request id -> the batch it came in
        self.test_filled: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.request_id not in self.test_batch:
            self.test_batch[request.request_id] = len(self.test_batch) // self.test_prompts
            if not (request.kv_transfer_params or {}).get(PREFILL_PARAM):
                self.test_filled.add(request.request_id)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output):
        scheduled = scheduler_output.num_scheduled_tokens
        if self.test_burst_batch is not None:
            slow = any(self.test_batch.get(r) == self.test_burst_batch for r in scheduled)
        else:
            slow = any(r in self.test_filled and self.test_batch[r] > 0 for r in scheduled)  # after the greedy pass
        if slow and self.test_delay_s:
            time.sleep(self.test_delay_s)
        return super().build_connector_meta(scheduler_output)
