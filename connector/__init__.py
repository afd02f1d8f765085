"""kvfill.connector: the DCP-aware block planner and the vLLM connector.

The data path, one file per role:

    options.py        kv_connector_extra_config -> FillOptions (frozen, validated once)
    specs.py          vLLM KV cache specs -> planner geometry (the spec adapter)
    scheduler.py      scheduler side: each request's external blocks (Planner.select)
    metadata.py       what the scheduler sends the workers each step; fill stats
    worker.py         worker side: vLLM's caches -> FillEngine; per step Planner.plan -> FillEngine.fill
    vllm_connector.py KVFillConnector, the KVConnectorBase_V1 facade (only delegates)
    plugin.py         the vllm.general_plugins entry point (the connector by name)
    planner.py        pure Python, no vLLM: select (per request) and plan (per step)

The connector classes are imported lazily so the planner can be used without
importing vLLM; vLLM finds them with ``"kv_connector_module_path": "kvfill.connector"``.
"""

__all__ = ["KVFillConnector", "KVFillConnectorMetadata"]


def __getattr__(name):
    if name in __all__:
        from . import vllm_connector

        return getattr(vllm_connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
