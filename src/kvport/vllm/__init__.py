"""kvport's connectors inside vLLM: OffloadingConnector, ExampleConnector, MultiConnector and
NoOpConnector, each with its kvport `kv_connector_extra_config`.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_connector_module_path": "kvport.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 4294967296}}'

    # any vLLM connector, its calls recorded for kvport's trace checker (kvport.vllm.recording):
    vllm serve MODEL --kv-transfer-config '{"kv_connector": "RecordingConnector",
        "kv_connector_module_path": "kvport.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"record_trace": "trace.jsonl",
            "connector": {"kv_connector": "ExampleConnector"}}}'
    # a SupportsHMA connector on a hybrid model, its KV cache groups kept: HMARecordingConnector

vLLM imports this module and asks it for the class named in `kv_connector`. Importing it needs
no vLLM; asking for a connector class imports vLLM lazily and checks its version (see compat).
"""

from __future__ import annotations

from typing import Any

# kvport's connectors (connector.py), and the recorder of any vLLM connector (recording.py)
CONNECTORS = ("OffloadingConnector", "ExampleConnector", "MultiConnector", "NoOpConnector")
RECORDERS = ("RecordingConnector", "HMARecordingConnector")
__all__ = [*CONNECTORS, *RECORDERS]


def __getattr__(name: str) -> Any:
    if name in CONNECTORS:
        from kvport.vllm import connector

        return getattr(connector, name)
    if name in RECORDERS:
        from kvport.vllm import recording

        return getattr(recording, name)
    raise AttributeError(f"module 'kvport.vllm' has no attribute {name!r}; its connectors: "
                         f"{__all__}")
