"""Engine configuration: one frozen record, validated at construction."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from kvport.trace.events import CALL_ORDERS, VLLM_0_32

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
WORKER_MODES = ("inproc", "process")
# The worker-side order in which the engine calls a KV connector's hooks (kvport.trace.events
# defines the names): vLLM 0.32's by default; "legacy" (vLLM before 0.32) on request, so a
# connector author can test a connector against both.
DEFAULT_KV_CONNECTOR_CALL_ORDER = VLLM_0_32
# Where the model, the KV pool and the sampler run: "cpu", "cuda" (torch's current CUDA device)
# or "cuda:N". Whether CUDA is there is the engine's check (kvport.engine.device), not the
# config's: a config is plain data that a machine without torch's CUDA build can still write.
DEVICE_PATTERN = re.compile(r"cpu|cuda(:[0-9]+)?")


@dataclass(frozen=True)
class EngineConfig:
    """Every engine setting, validated at construction. Fields keep the values given, except
    kv_transfer_config, which is normalized to a KVTransferConfig (or None), and device, which
    is kept as a string (a torch.device given becomes the string it prints)."""

    model: str = "builtin:tiny-llama"
    dtype: str = "float32"
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # size of the KV pool; None: from kv_cache_bytes
    kv_cache_bytes: int | None = None  # None: enough for max_num_seqs full requests, capped
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # None: the model's own limit (max_position_embeddings), capped by what the pool can hold;
    # the engine core resolves it (EngineCore.config always holds a number).
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    async_scheduling: bool = False  # schedule step N+1 while step N runs
    worker: str = "inproc"  # "inproc": runner in this process; "process": in a child process
    # None: no KV connector. Also accepts the record's dict or JSON text (as on the command
    # line): __post_init__ parses either into a KVTransferConfig, so it is always one or None.
    kv_transfer_config: KVTransferConfig | None = None
    kv_connector_call_order: str = DEFAULT_KV_CONNECTOR_CALL_ORDER  # one of CALL_ORDERS
    seed: int = 0
    # "cpu", "cuda" or "cuda:N" (DEVICE_PATTERN); a torch.device is kept as its string.
    device: str | torch.device = "cpu"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is None and name == "max_model_len":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int)
                                               or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes!r}")
        if self.num_kv_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_kv_blocks or kv_cache_bytes, not both")
        if self.worker not in WORKER_MODES:
            raise ValueError(f"worker must be one of {WORKER_MODES}, got {self.worker!r}")
        if self.kv_connector_call_order not in CALL_ORDERS:
            raise ValueError(f"kv_connector_call_order must be one of {CALL_ORDERS}, "
                             f"got {self.kv_connector_call_order!r}")
        object.__setattr__(self, "device", normalize_device(self.device))
        # Frozen, so the parsed record is set past the dataclass's guard (see the field).
        object.__setattr__(self, "kv_transfer_config", KVTransferConfig.from_any(self.kv_transfer_config))
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; accepted: {sorted(known)}")
        return cls(**kwargs)


def normalize_device(device: object) -> str:
    """`device` as its string ("cpu", "cuda", "cuda:N"); a ValueError naming anything else.
    A torch.device is accepted as the string it prints (torch is only looked at when the
    caller imported it: no torch.device exists otherwise)."""
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and isinstance(device, torch_mod.device):
        device = str(device)
    if not isinstance(device, str) or DEVICE_PATTERN.fullmatch(device) is None:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N' (N a CUDA device index), "
                         f"got {device!r}")
    return device


KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KVTransferConfig:
    """Which KV connector to run and its settings, in vLLM's JSON shape."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_module_path: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    # What a failed load does to its request: recompute from the last good block, or fail it.
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ValueError(f"kv_connector must be a connector name, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                             f"got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a dict, got "
                             f"{type(self.kv_connector_extra_config).__name__}")

    @classmethod
    def from_any(cls, value: KVTransferConfig | dict[str, Any] | str | None) -> KVTransferConfig | None:
        """Accept the config object, its dict, or its JSON text (as on the command line)."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_transfer_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a dict or JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown kv_transfer_config key(s) {unknown}; accepted: {sorted(known)}")
        if "kv_connector" not in value:
            raise ValueError("kv_transfer_config needs 'kv_connector' (the connector name)")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
