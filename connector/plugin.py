"""vLLM general plugin: makes ``"kv_connector": "KVFillConnector"`` work by name.

Declared in setup.cfg under the ``vllm.general_plugins`` entry points, so vLLM
calls ``register`` in every process it starts; it also adds kvfill's check
of a request's ``kvfill_prefill`` to vLLM's front-end checks
(``request_params.py``), which only the process answering a client runs.
"""

CONNECTOR_NAME = "KVFillConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from .request_params import install_param_check

    # A malformed kvfill_prefill refused where vLLM's front end checks a request (HTTP 400, offline error):
    # installed everywhere, run only there.
    install_param_check()

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, "kvfill.connector.vllm_connector", CONNECTOR_NAME)
