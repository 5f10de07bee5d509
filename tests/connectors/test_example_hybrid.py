"""ExampleConnector on a hybrid model (tiny-gemma3: two sliding-window groups, window 48, and one
full-attention group; blocks of 16 tokens, so a sliding layer's window at a block boundary is the
3 blocks before it). It is SupportsHMA: the engine keeps the groups; a layer stores what its
group holds at the aligned end (a sliding layer only its window) and loads it into its group's
table; greedy output equals no connector, in every mode, with chunked prefill, preemption and
partial local hits; an entry of the grouped layout is never read by a run with one group.
First the two halves without an engine, on a pool of two groups."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from connector_fakes import new_req, sched_out
from hybrid_engine import (
    BLOCK, GREEDY, aligned, example, finish, gemma, hybrid_prompts, one_by_one, reference_tokens,
    tokens,
)
from safetensors.torch import load_file
from utils import make_request

from kvport.config import KVTransferConfig
from kvport.connectors.base import (
    ForwardContext, KVCacheGroupSpec, KVCacheSpec, KVConnectorRole, layer_name,
)
from kvport.connectors.example import ExampleConnector, ExampleConnectorMetadata, entry_key
from kvport.connectors.example_layout import EntryLayout, GroupSpan
from kvport.connectors.factory import create_connector
from kvport.connectors.hma import supports_hma

# ---- the halves without an engine: 4 layers in two groups, block size 4 -----------------------

BS = 4
GROUPS = (KVCacheGroupSpec((0, 2), 8), KVCacheGroupSpec((1, 3), None))  # sliding 8, full
SPEC = KVCacheSpec(32, BS, 4, 2, 3, "float32", "test-layout", hash_root=b"root", groups=GROUPS)
PROMPT = list(range(100, 121))  # 21 tokens: aligned prefix 20 = 5 blocks
# The token at 20 reads back to token 13 in the sliding group: its blocks 3 and 4.


def halves(root: Path, spec: KVCacheSpec = SPEC) -> tuple[ExampleConnector, ExampleConnector]:
    config = KVTransferConfig("ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": str(root)})
    sched = create_connector(config, KVConnectorRole.SCHEDULER)
    worker = create_connector(config, KVConnectorRole.WORKER)
    assert isinstance(sched, ExampleConnector) and isinstance(worker, ExampleConnector)
    sched.set_kv_cache_spec(spec)
    return sched, worker


def admit(sched: ExampleConnector, rid: str, tables: tuple[list[int], ...], num_external: int = 0,
          num_local: int = 0) -> ExampleConnectorMetadata:
    """Admit a request for PROMPT with the rest of its prompt scheduled in one step."""
    req = make_request(rid, PROMPT)
    sched.update_state_after_alloc(req, tables, num_external)
    computed = num_local + num_external
    meta = sched.build_connector_meta(sched_out(
        new=[new_req(req, tables, computed)],  # type: ignore[arg-type]
        scheduled={rid: len(PROMPT) - computed}))
    assert isinstance(meta, ExampleConnectorMetadata)
    return meta


def pool(seed: int | None) -> torch.Tensor:
    """(blocks, slots, 2, block_size, heads, head_dim): random, or zeros (seed None)."""
    shape = (SPEC.num_blocks, SPEC.num_slots, 2, BS, SPEC.num_kv_heads, SPEC.head_dim)
    if seed is None:
        return torch.zeros(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def worker_step(worker: ExampleConnector, meta: ExampleConnectorMetadata,
                kv: torch.Tensor) -> set[int]:
    """One step of the worker half as the driver runs it: every layer gets its slot's view."""
    worker.register_kv_caches(kv, SPEC)
    ctx = ForwardContext(kv, {}, 0)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(ctx)
    for layer in range(SPEC.num_layers):
        worker.wait_for_layer_load(layer_name(layer))
        worker.save_kv_layer(layer_name(layer), kv[:, SPEC.layer_slot(layer)], ctx)
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return errors


def test_example_connector_declares_hma() -> None:
    assert supports_hma(ExampleConnector)


@pytest.mark.parametrize(("num_local", "spans"), [
    # No local hit: the sliding group loads its window (blocks 3, 4), the full group all 5.
    pytest.param(0, (GroupSpan(12, (13, 14)), GroupSpan(0, (1, 2, 3, 4, 5))), id="no-local-hit"),
    # 2 local blocks: the window starts after them; the full group loads past them.
    pytest.param(8, (GroupSpan(12, (13, 14)), GroupSpan(8, (3, 4, 5))), id="hit-before-window"),
    # 4 local blocks: past the window's start, both groups load only what is left.
    pytest.param(16, (GroupSpan(16, (14,)), GroupSpan(16, (5,))), id="hit-inside-window"),
])
def test_a_load_fills_each_groups_table_from_the_later_of_hit_and_window(
        tmp_path: Path, num_local: int, spans: tuple[GroupSpan, ...]) -> None:
    sched, _ = halves(tmp_path)
    # The sliding table holds the null block (0) where its window at 20 tokens has moved past.
    tables = ([0, 0, 0, 13, 14, 15], [1, 2, 3, 4, 5, 6])
    meta = admit(sched, "r", tables, num_external=20 - num_local, num_local=num_local)
    (load,) = meta.loads
    assert load.spans == spans and load.num_tokens == 20 and meta.stores == []


def test_a_sliding_layer_stores_its_window_and_loads_it_into_its_groups_blocks(
        tmp_path: Path) -> None:
    sched, worker = halves(tmp_path)
    src = pool(seed=1)
    meta = admit(sched, "w", ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]))
    (store,) = meta.stores
    assert store.spans == (GroupSpan(12, (4, 5)), GroupSpan(0, (7, 8, 9, 10, 11)))
    assert worker_step(worker, meta, src) == set()
    (key,) = os.listdir(tmp_path)
    entry = tmp_path / key
    tokens = {i: load_file(entry / f"{layer_name(i)}.safetensors")["kv_cache"].shape[0]
              for i in range(4)}
    assert tokens == {0: 8, 2: 8, 1: 20, 3: 20}  # sliding layers 0, 2: their window only
    # Layer 2 (sliding, slot 1): its first token is token 12, block 4's first.
    assert torch.equal(load_file(entry / "layers.2.safetensors")["kv_cache"][0],
                       src[4, 1, :, 0])

    reader = halves(tmp_path)[0]
    assert reader.get_num_new_matched_tokens(make_request("r", PROMPT), 0) == (20, False)
    meta = admit(reader, "r", ([0, 0, 0, 13, 14, 15], [16, 17, 18, 19, 20, 21]), 20)
    dst = pool(seed=None)
    assert worker_step(worker, meta, dst) == set()
    assert torch.equal(dst[[13, 14]], src[[4, 5]])  # both sliding layers
    assert torch.equal(dst[16:21], src[7:12])  # both full layers
    written = {13, 14, *range(16, 21)}
    assert torch.count_nonzero(dst[[b for b in range(32) if b not in written]]) == 0  # null too


def test_a_load_the_entry_cannot_supply_exactly_is_a_load_error(tmp_path: Path) -> None:
    """A span that starts before what a layer's file holds (here the sliding group asks for
    every block) writes nothing and reports every block of the load (recomputed)."""
    sched, worker = halves(tmp_path)
    worker_step(worker, admit(sched, "w", ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])), pool(seed=3))
    meta = admit(halves(tmp_path)[0], "r", ([0, 0, 0, 13, 14], [16, 17, 18, 19, 20]), 20)
    (load,) = meta.loads
    bad = dataclasses.replace(load, spans=(GroupSpan(0, (11, 12, 13, 14, 15)), load.spans[1]))
    dst = pool(seed=None)
    assert worker_step(worker, ExampleConnectorMetadata(loads=[bad]), dst) == set(bad.block_ids)
    assert torch.count_nonzero(dst) == 0


def test_the_group_layout_is_part_of_the_key(tmp_path: Path) -> None:
    sched, worker = halves(tmp_path)
    worker_step(worker, admit(sched, "w", ([1, 2, 3, 4, 5], [6, 7, 8, 9, 10])), pool(seed=2))
    req = make_request("r", PROMPT)
    (key,) = os.listdir(tmp_path)
    assert key == entry_key(req, b"root" + EntryLayout(GROUPS).key_tag())
    assert key != entry_key(req, b"root")  # what the same model with one group reads
    # One group (a non-hybrid model, or a caller without SupportsHMA): keys as they always were.
    assert EntryLayout(()).key_tag() == b""
    single = halves(tmp_path, KVCacheSpec(32, BS, 4, 2, 3, "float32", "test-layout",
                                          hash_root=b"root"))[0]
    assert single.get_num_new_matched_tokens(req, 0) == (0, False)


# ---- in the engine -----------------------------------------------------------------------------

MODES: dict[str, dict[str, Any]] = {"sync": {}, "async": {"async_scheduling": True},
                                    "process": {"worker": "process"}}


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return reference_tokens()


@pytest.mark.parametrize("mode", MODES)
def test_every_prompt_comes_back_from_its_entry_after_a_reset(
        tmp_path: Path, reference: list[list[int]], mode: str) -> None:
    llm = gemma(example(tmp_path / "s"), tmp_path / "t.jsonl", **MODES[mode])
    assert llm.engine.kv_cache_manager.group_windows == (48, 48, None)  # the groups are kept
    prompts = hybrid_prompts()
    assert tokens(llm, prompts) == reference
    assert len(os.listdir(tmp_path / "s")) == 4
    llm.reset_prefix_cache()
    assert one_by_one(llm, prompts) == (reference, aligned(prompts))
    assert len(os.listdir(tmp_path / "s")) == 4  # nothing stored twice
    finish(llm, tmp_path / "t.jsonl")


def test_sliding_layers_store_only_their_window(tmp_path: Path,
                                                reference: list[list[int]]) -> None:
    llm = gemma(example(tmp_path / "s"), tmp_path / "t.jsonl")
    short = hybrid_prompts()[0][:40]  # aligned prefix 32: inside the window, every block
    assert tokens(llm, hybrid_prompts()[:2]) == reference[:2]
    tokens(llm, [short])
    sizes = sorted(
        tuple(load_file(entry / f"{layer_name(i)}.safetensors")["kv_cache"].shape[0]
              for i in range(6))
        for entry in (tmp_path / "s").iterdir())
    # Layers 0, 1, 3, 4 slide (groups (0, 3) and (1, 4)); 2 and 5 attend to everything.
    assert sizes == [(32,) * 6, (48, 48, 192, 48, 48, 192), (48, 48, 224, 48, 48, 224)]
    finish(llm, tmp_path / "t.jsonl")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_and_preemption(tmp_path: Path, reference: list[list[int]],
                                        async_scheduling: bool) -> None:
    # Chunks of 32 tokens: a sliding group frees blocks while the prompt is still prefilling,
    # and the store goes out with the chunk that completes the aligned prefix; 48 blocks in
    # three groups cannot hold four such requests: one is preempted.
    llm = gemma(example(tmp_path / "s"), tmp_path / "t.jsonl", num_kv_blocks=48,
                max_num_batched_tokens=32, async_scheduling=async_scheduling)
    prompts = hybrid_prompts()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    llm.reset_prefix_cache()
    assert one_by_one(llm, prompts) == (reference, aligned(prompts))
    finish(llm, tmp_path / "t.jsonl")


def test_a_partial_local_hit_loads_only_the_rest(tmp_path: Path,
                                                 reference: list[list[int]]) -> None:
    llm = gemma(example(tmp_path / "s"), tmp_path / "t.jsonl")
    prompts = hybrid_prompts()
    assert one_by_one(llm, prompts[1:2])[0] == reference[1:2]  # stores prompt 1's entry
    llm.reset_prefix_cache()
    assert one_by_one(llm, prompts[:1])[0] == reference[:1]  # its 4 shared blocks, local now
    before = llm.get_metrics()["prefix_cache"]["num_hit_tokens"]
    # 4 blocks hit locally in every group; the entry supplies the full group's blocks 4-11 and
    # the sliding groups' window before 192 (blocks 9-11).
    assert one_by_one(llm, prompts[1:2]) == (reference[1:2], aligned(prompts[1:2]))
    assert llm.get_metrics()["prefix_cache"]["num_hit_tokens"] - before == 4 * BLOCK
    finish(llm, tmp_path / "t.jsonl")


def test_a_run_with_one_group_never_reads_grouped_entries(
        tmp_path: Path, reference: list[list[int]]) -> None:
    prompts = hybrid_prompts()
    grouped = gemma(example(tmp_path / "s"), tmp_path / "grouped.jsonl")
    assert tokens(grouped, prompts) == reference
    finish(grouped, tmp_path / "grouped.jsonl")
    grouped_entries = set(os.listdir(tmp_path / "s"))
    # NoOpConnector is not SupportsHMA, so neither is the MultiConnector: one group of every
    # layer, over the same directory.
    single = gemma({"kv_connector": "MultiConnector", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "NoOpConnector"}, example(tmp_path / "s")]}},
        tmp_path / "single.jsonl")
    assert single.engine.kv_cache_manager.group_windows == (None,)
    assert one_by_one(single, prompts)[0] == reference
    assert single.engine.scheduler.xfer.stats.num_hit_tokens == 0  # no grouped entry matched
    own = set(os.listdir(tmp_path / "s")) - grouped_entries
    assert len(own) == 4  # its own entries, every layer holding every aligned token
    assert {load_file(tmp_path / "s" / e / "layers.0.safetensors")["kv_cache"].shape[0]
            for e in own} == set(aligned(prompts))
    single.reset_prefix_cache()
    assert one_by_one(single, prompts) == (reference, aligned(prompts))
    finish(single, tmp_path / "single.jsonl")
