"""The null reference for fill benchmarks: grants what kvfill grants, writes nothing.

A benchmark tool, not a connector to benchmark with: its caches keep whatever
memory held, so decode runs on garbage.  It is KVFillConnector with the
worker's fill removed - the same scheduler side, metadata and token grants -
so its serving figures are the limit any fill can reach.  Loaded by module
path (never registered by name):

    --kv-transfer-config '{"kv_connector": "NullFillConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "kvfill.bench.null_connector"}'
"""
from __future__ import annotations

from typing import Any

from kvfill.connector.vllm_connector import KVFillConnector


class NullFillConnector(KVFillConnector):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None


# vLLM's factory loads the class named by "kv_connector" from this module.
KV_TRANSFER_CONFIG = {
    "kv_connector": "NullFillConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "kvfill.bench.null_connector",
}
