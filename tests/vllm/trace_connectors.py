"""Small vLLM connectors for the trace tests, loaded by vLLM with
`"kv_connector_module_path": "trace_connectors"` (run_trace.py puts this directory on sys.path).

AsyncLoadExample is vLLM's ExampleConnector (prompt KV saved to files, keyed by the prompt) with
its loads made asynchronous: a hit is answered `(n, True)`, the request waits in
WAITING_FOR_REMOTE_KVS, the worker copies the files into the registered KV caches in
`start_load_kv` (which may run on a step without a forward) and reports the request in that
step's `finished_recving`. Stores are ExampleConnector's own.

StaleAnswerAsyncExample re-creates the preemption seed: it remembers, per request, the hit it
found the first time it was asked and answers later questions from that memory. After a
preemption vLLM asks again with the request's local prefix-cache hit, which now covers the
remembered hit: the answer becomes `(0, True)`, which the contract forbids (rule S3). vLLM 0.32
drops the async flag when the local hit ends inside a block, and otherwise stops on a bare
`assert num_external_computed_tokens > 0` in its scheduler. The connector writes every such
answer, with its own count of `build_connector_meta` calls (the step), to `stale_log`, so the
test knows independently where the checker must point.

PreemptionsAfterBindMulti re-creates the seed "metadata used before preemptions are handled" in
a composite connector: vLLM's MultiConnector, except that on a step that preempted requests it
binds its children's metadata first and hands them the preemptions only afterwards (vLLM calls
the composite itself in the right order). Its children, each wrapped in a recorder, see the
broken order (rules W1 and W2 in their traces) on exactly the steps that preempted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    ReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector


@dataclass
class AsyncLoadMetadata(ExampleConnectorMetadata):
    loads: list[tuple[str, ReqMeta]] = field(default_factory=list)  # (request id, what to load)


class AsyncLoadExample(ExampleConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._new_loads: dict[str, tuple[list[int], list[int]]] = {}  # req -> (tokens, blocks)
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._done: set[str] = set()
        self._builds = 0

    # ---- scheduler side ----

    def _hit_tokens(self, request: Any, num_computed_tokens: int) -> int:
        n, _ = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return max(int(n or 0), 0)

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        n = self._hit_tokens(request, num_computed_tokens)
        return n, n > 0

    def _plan_load(self, request: Any, blocks: Any) -> None:
        prompt = list(request.prompt_token_ids or [])
        self._new_loads[request.request_id] = (prompt, list(blocks.get_block_ids()[0]))

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._plan_load(request, blocks)
        super().update_state_after_alloc(request, blocks, 0)  # no synchronous load, ever

    def build_connector_meta(self, scheduler_output: Any) -> AsyncLoadMetadata:
        self._builds += 1
        stores = super().build_connector_meta(scheduler_output)
        meta = AsyncLoadMetadata(requests=stores.requests)
        for rid, (tokens, blocks) in self._new_loads.items():
            meta.loads.append((rid, ReqMeta.make_meta(tokens, blocks, self._block_size,
                                                      is_store=False, mm_hashes=[])))
        self._new_loads = {}
        return meta

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AsyncLoadMetadata), meta
        for rid, load in meta.loads:
            if len(load.slot_mapping):
                blocks = load.slot_mapping // self._block_size
                offsets = load.slot_mapping % self._block_size
                for layer, cache in self._kv_caches.items():
                    path = self._generate_filename_debug(layer, load.token_ids, [])
                    cache[blocks, :, offsets] = safetensors.torch.load_file(path)["kv_cache"]
            self._done.add(rid)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._done = self._done, set()
        return None, done or None


class StaleAnswerAsyncExample(AsyncLoadExample):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._first_hit: dict[str, int] = {}  # req -> prompt tokens found the first time
        self._stale_log = self._kv_transfer_config.get_from_extra_config("stale_log", None)

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid not in self._first_hit:
            n = self._hit_tokens(request, num_computed_tokens)
            if n > 0:
                self._first_hit[rid] = n + num_computed_tokens
            return n, n > 0
        # The defect: the memory of the first answer outlives the preemption.
        n = max(self._first_hit[rid] - num_computed_tokens, 0)
        if n == 0 and self._stale_log:
            with open(self._stale_log, "a") as f:
                f.write(json.dumps({"req_id": rid, "step": self._builds}) + "\n")
        return n, True

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        self._first_hit.pop(request.request_id, None)
        return super().request_finished(request, block_ids)


class PreemptionsAfterBindMulti(MultiConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._late: Any = None  # the metadata whose preemptions are handed over after the bind

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        meta.preempted = bool(scheduler_output.preempted_req_ids)
        return meta

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if getattr(kv_connector_metadata, "preempted", False):
            self._late = kv_connector_metadata  # the defect: held back until after the bind
            return
        super().handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        late, self._late = self._late, None
        if late is not None:
            super().handle_preemptions(late)


class ZeroLoadRecvExample(AsyncLoadExample):
    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            self._new_loads[request.request_id] = ([], [])  # the defect: a load of nothing
        super().update_state_after_alloc(request, blocks, num_external_tokens)


class LateStoreExample(ExampleConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._this_step: list[tuple[str, torch.Tensor, Any, Any]] = []
        self._last_step: list[tuple[str, torch.Tensor, Any, Any]] = []

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._this_step.append((layer_name, kv_layer, attn_metadata,
                                self._get_connector_metadata()))

    def wait_for_save(self) -> None:
        # The defect: the previous step's saves run now, from whatever those slots hold now.
        late, self._last_step, self._this_step = self._last_step, self._this_step, []
        bound = self._connector_metadata
        try:
            for layer_name, kv_layer, attn_metadata, meta in late:
                self._connector_metadata = meta
                super().save_kv_layer(layer_name, kv_layer, attn_metadata)
        finally:
            self._connector_metadata = bound


class Hooks034Example(ExampleConnector):
    """vLLM's ExampleConnector answering vLLM 0.34's hooks unlike the base (which 0.32 lacks): a
    recorder around it must give vLLM these answers, not the base's."""

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> int:
        return 1  # KVCacheAccess.REGISTERS in 0.34: one physical allocation per segment

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        return True

    def may_load_async(self, request: Any) -> bool:
        return True
