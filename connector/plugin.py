"""vLLM's plugin hook for the connector's own distribution (``agentkv-connector``).

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes at start-up,
possibly more than once. ``register`` adds ``AgentKVConnector`` to vLLM's connector registry,
so ``--kv-transfer-config '{"kv_connector": "AgentKVConnector", ...}'`` works after a ``pip
install``, without ``kv_connector_module_path``. The adapter module is imported only when vLLM
creates the connector.
"""

from __future__ import annotations

from contextlib import suppress
from typing import Final

CONNECTOR_NAME: Final = "AgentKVConnector"
ADAPTER_MODULE: Final = "connector.vllm_adapter"


def register() -> None:
    """Register the connector with vLLM once per process (a second call does nothing)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import (  # noqa: PLC0415
        KVConnectorFactory,
    )

    with suppress(ValueError):  # registered already: vLLM loads plugins again in some processes
        KVConnectorFactory.register_connector(CONNECTOR_NAME, ADAPTER_MODULE, CONNECTOR_NAME)
