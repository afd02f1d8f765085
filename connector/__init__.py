"""kvfill.connector: the DCP-aware block planner and the vLLM connector.

``planner`` is pure Python; ``specs`` adapts vLLM's KV cache specs to it;
``vllm_connector`` holds ``KVFillConnector``.  The connector classes are
imported lazily so the planner can be used without importing vLLM; vLLM finds
them with ``"kv_connector_module_path": "kvfill.connector"``.
"""

__all__ = ["KVFillConnector", "KVFillConnectorMetadata"]


def __getattr__(name):
    if name in __all__:
        from . import vllm_connector

        return getattr(vllm_connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
