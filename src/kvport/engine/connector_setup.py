"""Builds the engine's connector halves and tells them which engine drives them.

The connector registry builds each half from the KV transfer config alone. What a connector's
call recorder must know of the engine itself, its worker call order for the trace header, is
passed to the registry's create_connector as an argument, so no connector imports the engine
and a MultiConnector's children learn it too.
"""

from __future__ import annotations

from kvport.config import EngineConfig
from kvport.connectors.base import KVConnectorBase, KVConnectorRole
from kvport.connectors.factory import create_connector
from kvport.trace.events import TraceHeader
from kvport.version import __version__

ENGINE_NAME = "kvport"


def trace_header(config: EngineConfig) -> TraceHeader:
    """What this engine writes at the head of a recorded trace."""
    return TraceHeader(ENGINE_NAME, __version__, config.kv_connector_call_order)


def create_engine_connector(config: EngineConfig, role: KVConnectorRole) -> KVConnectorBase | None:
    """The connector half for `role`, or None without a KV transfer config."""
    ktc = config.kv_transfer_config
    if ktc is None:
        return None
    return create_connector(ktc, role, trace_header(config))
