"""kvport: keep and move the KV cache of LLM inference."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvport.version import __version__ as __version__  # the package face shows it

__all__ = ["LLM", "SamplingParams", "EngineConfig", "KVTransferConfig", "RequestOutput",
           "CompletionOutput", "RequestMetrics"]

if TYPE_CHECKING:
    from kvport.config import EngineConfig, KVTransferConfig
    from kvport.engine.llm import LLM
    from kvport.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from kvport.sampling_params import SamplingParams

_LAZY = {
    "LLM": "kvport.engine.llm",
    "SamplingParams": "kvport.sampling_params",
    "EngineConfig": "kvport.config",
    "KVTransferConfig": "kvport.config",
    "RequestOutput": "kvport.outputs",
    "CompletionOutput": "kvport.outputs",
    "RequestMetrics": "kvport.outputs",
}


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    # Lazy, so that `import kvport` (and the CLI's --help) does not pay for importing torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvport' has no attribute {name!r}")
