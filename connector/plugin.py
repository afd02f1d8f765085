"""vLLM general plugin: makes ``"kv_connector": "KVFillConnector"`` work by name.

Declared in setup.cfg under the ``vllm.general_plugins`` entry points, so vLLM
calls ``register`` in every process it starts.
"""

CONNECTOR_NAME = "KVFillConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvfill.connector.vllm_connector", CONNECTOR_NAME)
