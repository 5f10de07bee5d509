"""The workload process of `kvport bench soak` (python -m kvport.bench.soak.child, its
ChildConfig as JSON on stdin).

It serves a mixed, seeded stream of requests in kvport's engine with the OffloadingConnector
until SIGTERM (then it finishes what is in flight, drains the connector, shuts down and exits
0) or until the soak kills it with SIGKILL at a random moment. It reports on a private copy of
its stdout, one JSON object a line (every other print goes to stderr):

    {"kind": "ready", "pid": N, "startup_s": S}          the engine is built
    {"kind": "request", "prompt": [...], "max_tokens": N, "output": [...], "status": "length",
     "prompt_kind": "shared" | "unique"}                 a finished request
    {"kind": "stats", "step_ms": [...], "metrics": {...}}  steps since the last, and
                                                         LLM.get_metrics() (cumulative)
    {"kind": "done"}                                      shut down cleanly

A line cut short by SIGKILL is the last one, and the reader drops it.

The workload: `SoakWorkload` draws, per request, either a prompt of one of a few shared prefixes
(one of a few suffixes after it: every later process asks for prefixes an earlier one stored, so
a restarted process hits disk or Redis) or a unique prompt (never asked before: stores only,
which keep the disk at capacity and Redis evicting), of several lengths and answer lengths.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

PREFIX_LENS = (48, 96, 160, 224, 320, 416)  # tokens of the shared prefixes
SUFFIX_VARIANTS = 6  # suffixes per prefix (a shared prompt repeats whole, too)
SUFFIX_LENS = (8, 40)  # min, max tokens of a suffix
UNIQUE_LENS = (24, 320)  # min, max tokens of a unique prompt
ANSWER_TOKENS = (4, 8, 16)
TOKEN_RANGE = 256  # byte tokens: every builtin model's tokenizer has them


@dataclass(frozen=True)
class ChildConfig:
    """What one workload process runs; `incarnation` seeds its own request stream (each restart
    asks in another order), `seed` the prompts all incarnations share."""

    model: str
    kv_transfer_config: dict[str, Any] | None
    seed: int = 0
    incarnation: int = 0
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int = 64
    concurrency: int = 4
    shared_fraction: float = 0.8
    stats_every_s: float = 0.5
    threads: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ChildConfig:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class SoakPrompt:
    token_ids: tuple[int, ...]
    max_tokens: int
    kind: str  # "shared" or "unique"


class SoakWorkload:
    """The seeded request stream. Prompts (shared prefixes and their suffixes) depend on `seed`
    alone; the order and the unique prompts on (`seed`, `incarnation`)."""

    def __init__(self, seed: int, incarnation: int, shared_fraction: float) -> None:
        if not 0.0 <= shared_fraction <= 1.0:
            raise ValueError(f"shared_fraction must be in [0, 1], got {shared_fraction}")
        base = random.Random(seed)
        self.prefixes = [[base.randrange(TOKEN_RANGE) for _ in range(n)] for n in PREFIX_LENS]
        self.suffixes = [[[base.randrange(TOKEN_RANGE)
                           for _ in range(base.randint(*SUFFIX_LENS))]
                          for _ in range(SUFFIX_VARIANTS)] for _ in PREFIX_LENS]
        # a string seed: random.Random hashes it deterministically (never Python's hash())
        self.rng = random.Random(f"{seed}/{incarnation}")
        self.shared_fraction = shared_fraction

    def next(self) -> SoakPrompt:
        rng = self.rng
        answer = rng.choice(ANSWER_TOKENS)
        if rng.random() < self.shared_fraction:
            i = rng.randrange(len(self.prefixes))
            tokens = self.prefixes[i] + rng.choice(self.suffixes[i])
            return SoakPrompt(tuple(tokens), answer, "shared")
        tokens = [rng.randrange(TOKEN_RANGE) for _ in range(rng.randint(*UNIQUE_LENS))]
        return SoakPrompt(tuple(tokens), answer, "unique")


class _Stop:
    """Set by SIGTERM: admit nothing more, finish, drain, exit."""

    requested = False

    @classmethod
    def handler(cls, signum: int, frame: Any) -> None:
        cls.requested = True


def _emit(out: TextIO, record: dict[str, Any]) -> None:
    out.write(json.dumps(record, separators=(",", ":")) + "\n")
    out.flush()


def serve(cfg: ChildConfig, out: TextIO) -> None:
    """Run the workload until SIGTERM; report on `out` (see the module docstring)."""
    import torch

    from kvport import LLM, SamplingParams

    started = time.monotonic()
    torch.set_num_threads(cfg.threads)
    llm = LLM(cfg.model, dtype=cfg.dtype, block_size=cfg.block_size,
              num_kv_blocks=cfg.num_kv_blocks, max_num_seqs=cfg.concurrency,
              kv_transfer_config=cfg.kv_transfer_config, seed=cfg.seed, **cfg.extra)
    engine = llm.engine
    workload = SoakWorkload(cfg.seed, cfg.incarnation, cfg.shared_fraction)
    _emit(out, {"kind": "ready", "pid": os.getpid(), "startup_s": time.monotonic() - started})
    in_flight: dict[str, SoakPrompt] = {}
    external: dict[str, int] = {}
    step_ms: list[float] = []
    last_stats = time.monotonic()
    n = 0
    while not _Stop.requested or in_flight:
        while not _Stop.requested and len(in_flight) < cfg.concurrency:
            prompt = workload.next()
            rid = f"i{cfg.incarnation}-r{n}"
            n += 1
            params = SamplingParams(max_tokens=prompt.max_tokens, temperature=0.0,
                                    ignore_eos=True)
            engine.add_request(rid, list(prompt.token_ids), params)
            in_flight[rid] = prompt
        t0 = time.perf_counter()
        finished = engine.step()
        step_ms.append((time.perf_counter() - t0) * 1000.0)
        for rid in in_flight:
            # the engine resets this when a parked request resumes: the largest value seen is
            # what the connector loaded (for a mismatch's report)
            req = engine.scheduler.requests.get(rid)
            if req is not None:
                external[rid] = max(external.get(rid, 0), req.num_external_computed_tokens)
        for req in finished:
            prompt = in_flight.pop(req.request_id)
            _emit(out, {"kind": "request", "prompt": list(prompt.token_ids),
                        "max_tokens": prompt.max_tokens, "prompt_kind": prompt.kind,
                        "output": list(req.output_token_ids),
                        "status": req.status.finish_reason or req.status.name,
                        "cached": req.num_cached_tokens or 0,
                        "external": max(external.pop(req.request_id, 0),
                                        req.num_external_computed_tokens),
                        "preemptions": req.num_preemptions})
        if time.monotonic() - last_stats >= cfg.stats_every_s:
            _emit(out, {"kind": "stats", "step_ms": step_ms, "metrics": llm.get_metrics()})
            step_ms = []
            last_stats = time.monotonic()
    while engine.has_pending_work():  # write-throughs still in flight
        engine.step()
    _emit(out, {"kind": "stats", "step_ms": step_ms, "metrics": llm.get_metrics()})
    llm.shutdown()
    _emit(out, {"kind": "done"})


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1:
        print("usage: python -m kvport.bench.soak.child [CONFIG_JSON] (default: stdin)",
              file=sys.stderr)
        return 2
    # stdin by default: the config holds the Redis URL, whose password a command line would
    # show to every user of the machine (ps)
    cfg = ChildConfig.from_json(args[0] if args else sys.stdin.read())
    signal.signal(signal.SIGTERM, _Stop.handler)
    # The protocol gets a private copy of stdout; fd 1 goes to stderr, so that a library's
    # print can never corrupt a report line.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    serve(cfg, out)
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
