"""Builds the engine's connector halves and tells them which engine drives them.

The connector registry builds each half from the KV transfer config alone. What a connector (or
its call recorder) must know of the engine itself, here its worker call order for the trace
header, is announced while the half is built (kvport.connectors.recording.engine_header), so no
connector imports the engine and a MultiConnector's children learn it too.
"""

from __future__ import annotations

from kvport import __version__
from kvport.config import EngineConfig
from kvport.connectors.base import KVConnectorBase, KVConnectorRole
from kvport.connectors.factory import create_connector
from kvport.connectors.recording import engine_header
from kvport.trace.events import TraceHeader

ENGINE_NAME = "kvport"


def trace_header(config: EngineConfig) -> TraceHeader:
    """What this engine writes at the head of a recorded trace."""
    return TraceHeader(ENGINE_NAME, __version__, config.kv_connector_call_order)


def create_engine_connector(config: EngineConfig, role: KVConnectorRole) -> KVConnectorBase | None:
    """The connector half for `role`, or None without a KV transfer config."""
    ktc = config.kv_transfer_config
    if ktc is None:
        return None
    with engine_header(trace_header(config)):
        return create_connector(ktc, role)
