"""What `kvport bench connector-overhead` measures, and its result.

One config for both engines: `engine` "kvport" (four engines in this process) or "vllm" (two
vLLM engine processes). `for_engine` gives each engine's defaults; the vLLM fields (the
interpreter, threads, `recorder`) matter only to vLLM.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvport.bench.common.command import JsonObject
from kvport.bench.common.machine import MachineInfo

ENGINES = ("kvport", "vllm")
NO_CONNECTOR, STORING = "no-connector", "offloading-stores-no-hits"
EXAMPLE, WRAPPED = "example", "example-in-recorder-off"
RECORDED = "example-in-recorder-recording"  # writing the trace, claim records included
EVENTS = "offloading-stores-events-metrics"  # STORING with KV events and stats on
# each engine's (prompt_len, decode_tokens, rounds): vLLM's are longer runs, fewer of them
_DEFAULTS = {"kvport": (128, 128, 7), "vllm": (256, 256, 5)}


@dataclass(frozen=True)
class OverheadConfig:
    model: str
    engine: str = "kvport"
    dtype: str = "float32"
    batch: int = 8
    prompt_len: int = 128
    decode_tokens: int = 128
    rounds: int = 7
    seed: int = 0
    vllm_python: str | None = None  # vLLM: the interpreter (default: this one)
    threads: int | None = None  # vLLM: OMP threads per engine (default: one per core)
    recorder: bool = False  # vLLM: ExampleConnector unwrapped vs in a RecordingConnector, off
    recording: bool = False  # vLLM: ... vs in a RecordingConnector writing its trace
    events: bool = False  # vLLM: kvport storing, without vs with KV events and metrics

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        for name in ("batch", "prompt_len", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.decode_tokens < 2:
            raise ValueError(f"decode_tokens must be >= 2, got {self.decode_tokens}")
        if self.recorder + self.recording + self.events > 1:
            raise ValueError("recorder, recording and events are different comparisons: pick one")

    @classmethod
    def for_engine(cls, engine: str, model: str, **given: Any) -> OverheadConfig:
        """The engine's default sizes, then what is `given` (field name -> value)."""
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        prompt_len, decode_tokens, rounds = _DEFAULTS[engine]
        return dataclasses.replace(cls(model, engine, prompt_len=prompt_len,
                                       decode_tokens=decode_tokens, rounds=rounds), **given)

    @property
    def target(self) -> tuple[str, str, float]:
        """(system, baseline, the least paired ratio) of the vLLM run's verdict."""
        if self.recorder:
            return WRAPPED, EXAMPLE, 0.98
        if self.recording:
            return RECORDED, EXAMPLE, 0.95
        return (EVENTS, STORING, 0.98) if self.events else (STORING, NO_CONNECTOR, 0.97)

    def to_json(self) -> JsonObject:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class OverheadSystem:
    """One engine's decode tokens/s: the median over rounds, its ratio to the baseline's
    median, and (vLLM) the median of the rounds' paired ratios and the bytes it stored."""

    name: str
    decode_tokens_per_s: float
    ratio_to_no_connector: float
    rounds_tokens_per_s: list[float]
    baseline: str | None = None  # vLLM's runs
    paired_ratio: float | None = None  # vLLM's runs
    bytes_stored: int | None = None  # vLLM's runs

    def to_json(self) -> JsonObject:
        out = dataclasses.asdict(self)
        return {k: v for k, v in out.items()
                if v is not None or k not in ("baseline", "paired_ratio", "bytes_stored")}


@dataclass(frozen=True)
class OverheadResult:
    config: OverheadConfig
    machine: MachineInfo
    systems: tuple[OverheadSystem, ...]
    trace_lines_written: int | None = None  # kvport's: lines the recording engine wrote
    vllm_info: JsonObject | None = None  # vLLM's: what its baseline engine reported

    def system(self, name: str) -> OverheadSystem:
        return next(s for s in self.systems if s.name == name)

    def to_json(self) -> JsonObject:
        head: JsonObject = {"benchmark": "connector-overhead"}
        if self.config.engine == "vllm":
            head["engine"] = "vllm"
        head.update(config=self.config.to_json(), machine=self.machine.to_json())
        if self.config.engine == "vllm":
            head["vllm"] = self.vllm_info
        head["systems"] = [s.to_json() for s in self.systems]
        if self.config.engine == "vllm":
            head["target"] = self.config.target[0]
        else:
            head["trace_lines_written"] = self.trace_lines_written
        return head
