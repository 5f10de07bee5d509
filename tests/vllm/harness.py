"""vLLM's real Scheduler driving kvport's OffloadingConnector, with a fake model on the worker.

The scheduler, its KV cache manager, requests and block hashes are vLLM's own. The worker side
is kvport's connector (role WORKER) over a small layer-major pool laid out as vLLM's CPU backend
lays it out ([num_blocks, heads, block, 2*head] per layer, one storage), driven in vLLM 0.32's
worker order: handle_preemptions, bind, start_load_kv (before the forward when the step has
synchronous loads, else after it), the forward, wait_for_save, get_finished, load errors, worker
metadata, clear.

The fake forward writes, into every slot a step computes, values derived from the token and its
position (and the layer): a block's bytes then depend only on the prefix it holds, so a block a
load filled must equal what computing it would have written (`expected_page`). It also reads,
as a real forward does, every full block of the prefix before the tokens it computes: each must
hold its KV by then, loaded or computed (`check_reads`; off where a load is meant to fail).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvport.model.builtin import builtin_model_dir  # noqa: E402
from kvport.vllm.connector import OffloadingConnector  # noqa: E402

BLOCK_SIZE = 16
NUM_LAYERS, HEADS, HEAD = 2, 1, 8
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
EOS = 2
init_none_hash(sha256)


def vllm_config(extra: dict[str, Any], max_num_batched_tokens: int = 256,
                max_num_seqs: int = 8, policy: str = "recompute",
                model_dir: Path | None = None) -> VllmConfig:
    model = ModelConfig(model=str(model_dir or builtin_model_dir("tiny-llama")), dtype="float32",
                        seed=0)
    return VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=512, enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_connector_module_path="kvport.vllm",
            kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy=policy),
        device_config=DeviceConfig("cpu"))


def kv_cache_config(num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float32)
    # kv_cache_layout: what vLLM's engine core records on every KVCacheConfig before connectors
    # are built (vllm/v1/engine/core.py), here the CPU backend's one layout.
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
                         kv_cache_layout="LBHNC")


def offload_extra(host_blocks: int = 64, disk_dir: Path | None = None,
                  sync_host_loads: bool = True) -> dict[str, Any]:
    page = HEADS * BLOCK_SIZE * 2 * HEAD * 4
    extra: dict[str, Any] = {"cpu_bytes_to_use": host_blocks * NUM_LAYERS * page,
                             "block_size": BLOCK_SIZE, "sync_host_loads": sync_host_loads}
    if disk_dir is not None:
        extra["secondary_tiers"] = [{"type": "disk", "root_dir": str(disk_dir),
                                     "max_bytes": 1 << 30}]
    return extra


def expected_page(token: int, position: int, layer: int) -> torch.Tensor:
    """The K|V values the fake forward writes for one token in one layer."""
    base = float((token * 131 + position * 7 + layer * 1009) % 100_003)
    return torch.arange(2 * HEAD, dtype=torch.float32) + base


@dataclass
class Harness:
    config: VllmConfig
    scheduler: Scheduler
    worker: OffloadingConnector
    storage: torch.Tensor  # (layers, blocks, heads, block, 2*head): vLLM CPU's layout
    finished: list[Request] = field(default_factory=list)
    steps: int = 0
    check_reads: bool = True

    @classmethod
    def build(cls, extra: dict[str, Any], num_blocks: int = 64, **kw: Any) -> Harness:
        config = vllm_config(extra, **kw)
        kcc = kv_cache_config(num_blocks)
        config.cache_config.num_gpu_blocks = num_blocks
        scheduler = Scheduler(vllm_config=config, kv_cache_config=kcc, log_stats=True,
                              structured_output_manager=StructuredOutputManager(config),
                              block_size=BLOCK_SIZE)
        worker = OffloadingConnector(config, KVConnectorRole.WORKER, kcc)
        storage = torch.zeros((NUM_LAYERS, num_blocks, HEADS, BLOCK_SIZE, 2 * HEAD))
        worker.register_kv_caches({name: storage[i] for i, name in enumerate(LAYERS)})
        return cls(config, scheduler, worker, storage)

    @property
    def connector(self) -> OffloadingConnector:
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector), connector
        return connector

    def add(self, rid: str, prompt: list[int], max_tokens: int = 3) -> Request:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        params.update_from_generation_config({}, EOS)
        req = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=params,
                      pooling_params=None, mm_features=None,
                      block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
        self.scheduler.add_request(req)
        return req

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        runner_out = self._execute(out)
        for engine_out in self.scheduler.update_from_output(out, runner_out).values():
            del engine_out  # finished requests are tracked through their status
        self.steps += 1
        return out

    def run(self, max_steps: int = 200) -> None:
        """Step while vLLM's engine would: requests, or connector push work in flight."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        w = self.worker
        meta = out.kv_connector_metadata
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if out.has_sync_kv_loads:  # the forward reads what they load
            w.start_load_kv(None)  # type: ignore[arg-type]
        sampled = {rid: self._forward(rid, n) for rid, n in out.num_scheduled_tokens.items()}
        if not out.has_sync_kv_loads:  # vLLM 0.32 starts async loads after the forward
            w.start_load_kv(None)  # type: ignore[arg-type]
        w.wait_for_save()
        results = w.get_transfer_results(out.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=w.build_connector_worker_meta())
        w.clear_connector_metadata()
        # Every scheduled request has an entry; a prefill chunk short of the end samples none.
        req_ids = list(sampled)
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[] if sampled[r] is None else [sampled[r]] for r in req_ids],
            logprobs=None,
            prompt_logprobs_dict={}, pooler_output=None,
            kv_connector_output=None if kv_out.is_empty() else kv_out)

    def _forward(self, rid: str, num_new: int) -> int | None:
        """Write the KV of the request's next `num_new` tokens; a token if it reaches the end."""
        req = self.scheduler.requests[rid]
        blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
        tokens = req.all_token_ids
        start = req.num_computed_tokens - num_new  # vLLM advanced it at schedule time
        if self.check_reads:
            for index in range(start // BLOCK_SIZE):
                self.check_block(req, index)
        for pos in range(start, start + num_new):
            block, offset = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            for layer in range(NUM_LAYERS):
                self.storage[layer, block, :, offset] = expected_page(tokens[pos], pos, layer)
        if start + num_new < len(tokens):
            return None  # a prefill chunk that does not reach the end
        return 1 + len(tokens) % 97  # depends on the length only, as kvport's fake runner

    def check_block(self, req: Request, index: int) -> None:
        """Pool block `index` of the request holds its tokens' KV (loaded or computed)."""
        block = self.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0][index]
        for offset in range(BLOCK_SIZE):
            pos = index * BLOCK_SIZE + offset
            for layer in range(NUM_LAYERS):
                got = self.storage[layer, block, 0, offset]
                want = expected_page(req.all_token_ids[pos], pos, layer)
                assert torch.equal(got, want), f"{req.request_id} block {index} pos {pos}"

    def assert_nothing_leaked(self) -> None:
        s = self.scheduler
        assert not s.requests and not s.waiting and not s.running, list(s.requests)
        assert not s.finished_recving_kv_req_ids
        pool = s.kv_cache_manager.block_pool
        assert all(b.ref_cnt == 0 for b in pool.blocks), "blocks still referenced"
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # block 0: vLLM's null block
        self.connector.scheduler_half.check_no_leaks()


def waiting_for_load(req: Request) -> bool:
    return req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
