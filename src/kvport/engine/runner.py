"""Model runner: owns the KV pool and per-request token state, runs one step of the model.

From a `SchedulerOutput` it builds the flattened batch (token ids, positions, slot mapping, block
tables), runs the model with paged attention, and samples one token for every request whose
scheduled tokens reach the end of what it knows. The runner appends its own sampled tokens to
its request state, so the next decode step needs nothing from the scheduler but block ids.

KV pool layout: see kvport.model.attention (block-contiguous across layers, for whole-block copies).
Device: the pool, the step's inputs and the sampler's generators live where the model's weights
are (`EngineConfig.device`). A step's inputs are built on the host, then copied over (a few
small copies per step, queued ahead of the forward); the sampled token ids come back in one copy
per step (kvport.model.sampler).
The runner also drives the worker half of the KV connector through one step
(kvport.connectors.driver), which is why it lives in the engine, above the model and the
connector API.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvport.config import DEFAULT_KV_CONNECTOR_CALL_ORDER
from kvport.connectors.base import ForwardContext, KVCacheGroupSpec, KVCacheSpec, KVConnectorBase
from kvport.connectors.driver import KVConnectorDriver
from kvport.engine.device import make_generator
from kvport.engine.step import ModelRunnerOutput, SchedulerOutput
from kvport.model.attention import (
    KV_LAYOUT, AttentionMetadata, DecodeRows, LayerPlace, PagedAttention, PrefillSeq,
    kv_cache_shape,
)
from kvport.model.config import ModelConfig
from kvport.model.kv_groups import KVCacheGroup, layer_slots, slots_per_block
from kvport.model.sampler import sample
from kvport.model.state_cache import PagedStateAttention
from kvport.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every token sampled so far (by this runner)
    block_ids: tuple[list[int], ...]  # a block table per KV cache group
    num_computed_tokens: int  # before the step being prepared
    sampling_params: SamplingParams
    generator: torch.Generator


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn_metadata: AttentionMetadata
    sample_req_ids: list[str]  # requests that get a token this step, in logits row order
    logits_indices: torch.Tensor  # (len(sample_req_ids),) index of each one's last token


def kv_cache_spec(model_config: ModelConfig, num_blocks: int, block_size: int,
                  dtype: torch.dtype, hash_root: bytes = b"",
                  groups: tuple[KVCacheGroup, ...] = ()) -> KVCacheSpec:
    """The pool as a connector sees it; several groups are named, one group is the default."""
    group_specs = (tuple(KVCacheGroupSpec(g.layer_ids, g.sliding_window, g.state) for g in groups)
                   if len(groups) > 1 else ())
    return KVCacheSpec(
        num_blocks=num_blocks, block_size=block_size, num_layers=model_config.num_hidden_layers,
        num_kv_heads=model_config.num_key_value_heads, head_dim=model_config.head_dim,
        dtype=str(dtype).removeprefix("torch."), layout=KV_LAYOUT, hash_root=hash_root,
        groups=group_specs)


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, model_config: ModelConfig, num_blocks: int,
        block_size: int, dtype: torch.dtype, connector: KVConnectorBase | None = None,
        hash_root: bytes = b"", call_order: str = DEFAULT_KV_CONNECTOR_CALL_ORDER,
        driver_cls: type[KVConnectorDriver] = KVConnectorDriver,
        groups: tuple[KVCacheGroup, ...] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """`driver_cls` drives `connector` through each step: KVConnectorDriver, or a subclass
        that changes how (a test puts a defect back with one). `groups`: the KV cache groups
        (default: one group of every layer). `device`: where the pool and the step's tensors
        go; None: where the model's weights are, which it must equal (a ValueError if not)."""
        weights_on = next(model.parameters()).device
        self.device = weights_on if device is None else torch.device(device)
        if self.device.index is None and self.device.type == weights_on.type:
            self.device = weights_on  # "cuda": the GPU the weights are on, by its index
        if self.device != weights_on:
            raise ValueError(f"the model's weights are on {weights_on}, the runner's device is "
                             f"{self.device}: load the model onto the engine's device")
        self.model = model
        self.hash_root = hash_root
        self.model_config = model_config
        self.block_size = block_size
        layers = model_config.num_hidden_layers
        self.groups = groups or (KVCacheGroup(tuple(range(layers)), None),)
        windows = [model_config.layer_window(i) for i in range(layers)]
        self.places = tuple(LayerPlace(g, slot, windows[layer]) for layer, (g, slot) in
                            enumerate(layer_slots(self.groups, layers)))
        # Zeros, not empty: padded block-table slots are read (then masked) and must not hold
        # NaN bit patterns, which would survive the masking as NaN * 0.
        # On the device: the connector gets this tensor (register_kv_caches, ForwardContext)
        # and picks its copy path from its device.
        self.kv_cache = torch.zeros(kv_cache_shape(model_config, num_blocks, block_size,
                                                   slots_per_block(self.groups)), dtype=dtype,
                                    device=self.device)
        self.requests: dict[str, CachedRequestState] = {}  # req_id -> state
        self.driver: KVConnectorDriver | None = None
        if connector is not None:
            self.driver = driver_cls(connector, self.kv_cache, self.kv_cache_spec, call_order)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return kv_cache_spec(self.model_config, self.kv_cache.shape[0], self.block_size,
                             self.kv_cache.dtype, self.hash_root, self.groups)

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched_out)
        ctx = ForwardContext(self.kv_cache, sched_out.num_scheduled_tokens, sched_out.step)
        if self.driver is not None:
            self.driver.pre_forward(sched_out, ctx)
        out = ModelRunnerOutput()
        if sched_out.total_num_scheduled_tokens > 0:
            try:
                self._forward_and_sample(sched_out, out)
            except Exception as exc:  # the step's requests fail; the engine goes on
                logger.exception("model step %d failed", sched_out.step)
                message = f"{type(exc).__name__}: {exc}"
                out = ModelRunnerOutput(failed_req_ids={r: message for r in sched_out.num_scheduled_tokens})
        if self.driver is not None:
            out.kv_connector_output = self.driver.post_forward(
                sched_out, did_forward=sched_out.total_num_scheduled_tokens > 0)
        return out

    def _forward_and_sample(self, sched_out: SchedulerOutput, out: ModelRunnerOutput) -> None:
        batch = self._prepare_inputs(sched_out)
        attn = (PagedStateAttention(self.kv_cache, batch.attn_metadata,
                                    self.model.attention_scale, self.block_size, self.driver,
                                    self.places)
                if self.model_config.mamba is not None else
                PagedAttention(self.kv_cache, batch.attn_metadata, self.model.attention_scale,
                               self.driver, self.places))
        with torch.inference_mode():
            hidden = self.model(batch.input_ids, batch.positions, attn, batch.logits_indices)
            logits = self.model.compute_logits(hidden)
        states = [self.requests[rid] for rid in batch.sample_req_ids]
        if not states:
            return
        sampled = sample(logits, [s.sampling_params for s in states], [s.generator for s in states])
        for state, token, lp in zip(states, sampled.token_ids, sampled.logprobs):
            state.token_ids.append(token)
            out.sampled_token_ids[state.req_id] = [token]
            if lp is not None:
                out.logprobs[state.req_id] = [lp]

    def _decode_rows(self, tables: list[list[int]], lens: list[int]) -> DecodeRows:
        """Block tables padded with block 0, and the keys each row sees."""
        max_blocks = max((len(t) for t in tables), default=0)
        out = torch.zeros((len(tables), max_blocks), dtype=torch.long)
        for i, t in enumerate(tables):
            out[i, :len(t)] = torch.tensor(t)
        return DecodeRows(out, torch.tensor(lens, dtype=torch.long), self.block_size)

    def shutdown(self) -> None:
        self.requests.clear()
        if self.driver is not None:
            self.driver.shutdown()

    def _update_states(self, sched_out: SchedulerOutput) -> None:
        for rid in sched_out.finished_req_ids:
            self.requests.pop(rid, None)
        for new in sched_out.scheduled_new_reqs:
            tokens = new.prompt_token_ids + new.output_token_ids
            old = self.requests.get(new.req_id)
            if old is None:
                gen = make_generator(self.device, new.sampling_seed)
                self.requests[new.req_id] = CachedRequestState(
                    new.req_id, tokens, tuple(list(t) for t in new.block_ids),
                    new.num_computed_tokens, new.sampling_params, gen)
            else:  # resumed (preemption, failed load): new blocks, same generator
                old.token_ids = tokens
                old.block_ids = tuple(list(t) for t in new.block_ids)
                old.num_computed_tokens = new.num_computed_tokens
        for cached in sched_out.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            for table, added in zip(state.block_ids, cached.new_block_ids, strict=True):
                table.extend(added)
            state.num_computed_tokens = cached.num_computed_tokens

    def _prepare_inputs(self, sched_out: SchedulerOutput) -> StepBatch:
        bs = self.block_size
        n_groups = len(self.groups)
        n_sched = sched_out.num_scheduled_tokens
        # Requests with one query token first (batched decode attention), then prefills.
        order = sorted(n_sched, key=lambda rid: n_sched[rid] != 1)
        input_ids: list[int] = []
        positions: list[int] = []
        # per group: each decode's table, each sampling request's table, each token's block
        decode_tables: list[list[list[int]]] = [[] for _ in range(n_groups)]
        sample_tables: list[list[list[int]]] = [[] for _ in range(n_groups)]
        slot_blocks: list[list[int]] = [[] for _ in range(n_groups)]
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        decode_ids: list[str] = []
        sample_ids: list[str] = []
        sample_lens: list[int] = []
        logits_idx: list[int] = []
        for rid in order:
            state = self.requests[rid]
            n, start = n_sched[rid], state.num_computed_tokens
            end = start + n
            assert end <= len(state.token_ids), f"{rid}: scheduled past its known tokens"
            assert all(len(t) * bs >= end for t in state.block_ids), \
                f"{rid}: {end} tokens need more blocks"
            query_start = len(input_ids)
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            num_blocks = -(-end // bs)
            tables = [t[:num_blocks] for t in state.block_ids]
            for g, table in enumerate(state.block_ids):
                slot_blocks[g].extend(table[p // bs] for p in range(start, end))
            if n == 1:
                decode_ids.append(rid)
                for g in range(n_groups):
                    decode_tables[g].append(tables[g])
                decode_lens.append(end)
            else:
                prefills.append(PrefillSeq(query_start, n, start,
                                           tuple(torch.tensor(t) for t in tables)))
            if end == len(state.token_ids):
                sample_ids.append(rid)
                for g in range(n_groups):
                    sample_tables[g].append(tables[g])
                sample_lens.append(end)
                logits_idx.append(len(input_ids) - 1)
            state.num_computed_tokens = end
        pos = torch.tensor(positions, dtype=torch.long)
        decodes = tuple(self._decode_rows(t, decode_lens) for t in decode_tables)
        # The rows that sample attend like decodes in the last layer (see LlamaForCausalLM).
        samples = (decodes if sample_ids == decode_ids  # a pure decode step: the same tables
                   else tuple(self._decode_rows(t, sample_lens) for t in sample_tables))
        meta = AttentionMetadata(
            slot_block_ids=tuple(torch.tensor(b, dtype=torch.long) for b in slot_blocks),
            slot_offsets=pos % bs, num_decode_tokens=len(decode_lens), decodes=decodes,
            prefills=prefills, samples=samples)
        # Built on the host (from Python lists), then copied to the device: the copies are
        # queued on the current stream, ahead of the forward that reads them.
        dev = self.device
        return StepBatch(torch.tensor(input_ids, dtype=torch.long).to(dev, non_blocking=True),
                         pos.to(dev, non_blocking=True), meta.to(dev), sample_ids,
                         torch.tensor(logits_idx, dtype=torch.long).to(dev, non_blocking=True))
