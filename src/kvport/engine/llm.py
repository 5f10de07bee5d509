"""`LLM`: offline generation over the engine core (vLLM's public shape)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, Union

from tqdm.auto import tqdm

from kvport.config import EngineConfig
from kvport.connectors.base import KVCacheEvent, plain_data
from kvport.engine.core import EngineCore
from kvport.engine.request import Request
from kvport.model.tokenizer import Tokenizer
from kvport.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvport.sampling_params import SamplingParams

PromptType = Union[str, Sequence[int]]


class LLM:
    def __init__(self, model: str = "builtin:tiny-llama", **kwargs: Any) -> None:
        """`kwargs` are EngineConfig's fields."""
        self._attach(EngineCore(EngineConfig.from_kwargs(model=model, **kwargs)))

    @classmethod
    def from_engine(cls, engine: EngineCore) -> LLM:
        """An LLM over an engine core the caller built, for what EngineCore takes beyond the
        config (a model already loaded, a driver class of its own)."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: EngineCore) -> None:
        self.engine = engine
        self.config = engine.config  # max_model_len resolved
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.loaded.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.

        Every prompt is checked before any work starts: one bad prompt rejects the whole call.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts")
        encoded = [self._encode(p) for p in prompt_list]
        for i, (_, ids) in enumerate(encoded):
            try:
                self.engine.validate_prompt(ids)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
        requests: list[Request] = []
        for (text, ids), params in zip(encoded, params_list):
            requests.append(self.engine.add_request(str(next(self._ids)), ids, params, prompt=text))
        bar = tqdm(total=len(requests), desc="generate", disable=not use_tqdm or len(requests) < 2)
        try:
            while self.engine.has_pending_work():
                finished = self.engine.step()
                if finished:
                    bar.update(len(finished))
        except BaseException:
            self.engine.abort_requests([r.request_id for r in requests])
            raise
        finally:
            bar.close()
        return [self._to_output(r) for r in requests]

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.get_tokenizer().encode(prompt)
        return None, [int(t) for t in prompt]

    def _to_output(self, req: Request) -> RequestOutput:
        tok = self.get_tokenizer()
        logprobs = req.logprobs if req.sampling_params.logprobs is not None else None
        completion = CompletionOutput(
            index=0,
            text=tok.decode(req.output_token_ids),
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
        )
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                 req.finished_time, req.num_preemptions)
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), [completion],
                             req.is_finished, req.num_cached_tokens or 0, metrics, req.error)

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool | None:
        """Drop the engine's own prefix cache; with `reset_connector`, also what the KV connector
        holds (its answer: None if it cannot, False if it failed)."""
        self.engine.reset_prefix_cache()
        connector = self.engine.scheduler.connector
        if reset_connector and connector is not None:
            return connector.reset_cache()
        return None

    def get_metrics(self) -> dict[str, Any]:
        """Cumulative counters: the engine's prefix cache, the scheduler's KV-transfer
        bookkeeping and the connector's own (for the OffloadingConnector: per tier)."""
        pool = self.engine.pool.stats
        bs = self.config.block_size
        sched = self.engine.scheduler
        connector = sched.connector
        return {
            "prefix_cache": {"num_queried_tokens": pool.num_queried_blocks * bs,
                             "num_hit_tokens": pool.num_hit_blocks * bs},
            "kv_transfer": dataclasses.asdict(sched.xfer.stats),
            "connector": plain_data(connector.get_metrics()) if connector is not None else {},
        }

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The KV connector's cache events since the last call, oldest first: blocks it stored
        (`removed=False`) or dropped, per medium (for the OffloadingConnector: "HOST"), keyed by
        block hash. A router that places requests where their prefix lives reads these. At most
        the last 10,000 are kept between calls; `get_metrics()["kv_transfer"]` counts the rest
        as `num_dropped_events`."""
        return self.engine.scheduler.xfer.take_events()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    for i, p in enumerate(items):
        if not isinstance(p, str) and not (isinstance(p, Sequence)
                                           and all(isinstance(t, int) for t in p)):
            raise TypeError(f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}")
    return items

