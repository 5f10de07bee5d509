"""ExampleConnector without an engine: scheduler half on real Requests and SchedulerOutputs,
worker half on a real pool tensor (block size 4, 2 layers)."""

from __future__ import annotations

import filecmp
import os
import pickle
import stat
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from connector_fakes import BLOCK_SIZE, make_kv_cache, new_req, sched_out, worker_step
from utils import make_request

from kvport.config import KVTransferConfig
from kvport.connectors.base import ForwardContext, KVConnectorRole, layer_name
from kvport.connectors.example import (
    ExampleConnector, ExampleConnectorMetadata, entry_key, num_aligned_tokens,
)
from kvport.connectors.example_storage import MANIFEST, gather, read_manifest, scatter
from kvport.connectors.factory import create_connector
from kvport.engine.hashing import namespace_hash
from kvport.engine.request import Request
from kvport.connectors.views import CachedRequestRecord
from kvport.sampling_params import SamplingParams

PROMPT = list(range(100, 111))  # 11 tokens: aligned prefix 8 = 2 blocks


def make_example(root: Path, role: KVConnectorRole, kv_role: str = "kv_both") -> ExampleConnector:
    config = KVTransferConfig("ExampleConnector", kv_role=kv_role,
                              kv_connector_extra_config={"shared_storage_path": str(root)})
    conn = create_connector(config, role)
    assert isinstance(conn, ExampleConnector)
    return conn


def halves(root: Path) -> tuple[ExampleConnector, ExampleConnector]:
    """(scheduler half, worker half) over one storage directory."""
    return make_example(root, KVConnectorRole.SCHEDULER), make_example(root, KVConnectorRole.WORKER)


def admit(sched: ExampleConnector, req: Request, block_ids: list[int], num_external: int = 0,
          num_local: int = 0, step: int = 0) -> ExampleConnectorMetadata:
    """Admit `req` with its whole prompt scheduled in one step; the step's metadata."""
    sched.update_state_after_alloc(req, block_ids, num_external)
    num_computed = num_local + num_external
    meta = sched.build_connector_meta(sched_out(
        step, new=[new_req(req, block_ids, num_computed)],
        scheduled={req.request_id: req.num_tokens - num_computed}))
    assert isinstance(meta, ExampleConnectorMetadata)
    return meta


def store(root: Path, prompt: list[int], kv: torch.Tensor, block_ids: list[int]) -> str:
    """Store `prompt` from `block_ids` of `kv` through both halves; returns the entry key."""
    sched, worker = halves(root)
    req = make_request("writer", prompt)
    meta = admit(sched, req, block_ids)
    assert [s.req_id for s in meta.stores] == ["writer"]
    worker_step(worker, meta, kv)
    key = entry_key(req)
    assert key is not None and read_manifest(str(root), key) is not None
    return key


def test_config_default_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    conn = create_connector(KVTransferConfig("ExampleConnector"), KVConnectorRole.SCHEDULER)
    assert isinstance(conn, ExampleConnector)
    assert os.path.basename(conn.root) == "example" and "kvport" in conn.root
    with pytest.raises(ValueError, match="shared_storag"):
        create_connector(KVTransferConfig("ExampleConnector", kv_connector_extra_config={
            "shared_storag": "/tmp/x"}), KVConnectorRole.SCHEDULER)
    with pytest.raises(ValueError, match="shared_storage_path"):
        create_connector(KVTransferConfig("ExampleConnector", kv_connector_extra_config={
            "shared_storage_path": 3}), KVConnectorRole.SCHEDULER)


def test_the_default_store_is_private_to_the_user(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """$TMPDIR/kvport-<uid>/example, 0o700 (not a shared /tmp/kvport/example that any local user
    could read, or fill with entries of their own); refused where someone else got there first."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    conn = create_connector(KVTransferConfig("ExampleConnector"), KVConnectorRole.SCHEDULER)
    root = tmp_path / f"kvport-{os.getuid()}" / "example"
    assert isinstance(conn, ExampleConnector) and conn.root == str(root)
    assert stat.S_IMODE(root.stat().st_mode) == stat.S_IMODE(root.parent.stat().st_mode) == 0o700
    root.chmod(0o777)
    with pytest.raises(ValueError, match=rf"the default shared_storage_path is not private "
                                         rf"\({root} is writable by group or others"):
        create_connector(KVTransferConfig("ExampleConnector"), KVConnectorRole.SCHEDULER)


@pytest.mark.parametrize(("num_prompt", "aligned"),
                         [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8), (11, 8)])
def test_aligned_prefix_leaves_a_token_to_compute(num_prompt: int, aligned: int) -> None:
    assert num_aligned_tokens(num_prompt, BLOCK_SIZE) == aligned


def test_key_covers_exactly_the_aligned_prefix() -> None:
    base = entry_key(make_request("a", PROMPT))
    # Tokens past the aligned prefix (8) do not matter, as long as the prefix length is the same.
    assert entry_key(make_request("b", PROMPT[:9] + [7, 7])) == base
    assert entry_key(make_request("c", PROMPT[:9])) == base
    # Another aligned length, another prefix token, or another model: another key.
    assert entry_key(make_request("d", PROMPT + [1, 2])) != base
    assert entry_key(make_request("e", [0] + PROMPT[1:])) != base
    other_model = Request("f", PROMPT, SamplingParams(), frozenset(), BLOCK_SIZE,
                          namespace_hash("other-model", "float32", BLOCK_SIZE, "test-layout"))
    assert entry_key(other_model) != base
    assert entry_key(make_request("g", PROMPT[:4])) is None  # no full aligned block


def test_save_then_load_into_other_blocks_is_identity(tmp_path: Path) -> None:
    src = make_kv_cache(seed=1)
    store(tmp_path, PROMPT, src, [3, 7, 9])
    sched, worker = halves(tmp_path)
    req = make_request("reader", PROMPT)
    assert sched.get_num_new_matched_tokens(req, 0) == (8, False)
    meta = admit(sched, req, [1, 2, 5], num_external=8)
    assert [(m.req_id, m.start_token, m.block_ids) for m in meta.loads] == [("reader", 0, (1, 2))]
    assert meta.stores == []  # never loaded and stored
    dst = make_kv_cache(seed=None)
    assert worker_step(worker, meta, dst)[2] == set()
    assert torch.equal(dst[[1, 2]], src[[3, 7]])
    assert torch.count_nonzero(dst[[0, 3, 4, 5, 6]]) == 0  # nothing else written


def test_partial_local_hit_loads_only_the_rest(tmp_path: Path) -> None:
    src = make_kv_cache(seed=2)
    store(tmp_path, PROMPT, src, [3, 7, 9])
    sched, worker = halves(tmp_path)
    req = make_request("reader", PROMPT)
    assert sched.get_num_new_matched_tokens(req, 4) == (4, False)  # block 0 is a local hit
    assert sched.get_num_new_matched_tokens(req, 8) == (0, False)
    meta = admit(sched, req, [10, 11, 12], num_external=4, num_local=4)
    assert [(m.start_token, m.block_ids) for m in meta.loads] == [(4, (11,))]
    dst = make_kv_cache(seed=None)
    worker_step(worker, meta, dst)
    assert torch.equal(dst[11], src[7])
    assert torch.count_nonzero(dst[10]) == 0  # the local hit's block is left alone


def test_entry_files_hold_one_tensor_per_layer(tmp_path: Path) -> None:
    src = make_kv_cache(seed=3)
    key = store(tmp_path, PROMPT, src, [3, 7, 9])
    entry = tmp_path / key
    assert sorted(os.listdir(entry)) == ["layers.0.safetensors", "layers.1.safetensors", MANIFEST]
    data = load_file(entry / "layers.1.safetensors")["kv_cache"]
    assert data.shape == (8, 2, 2, 3)  # (tokens, K/V, kv_heads, head_dim)
    assert torch.equal(data[5], src[7, 1, :, 1])  # token 5 = block 7, offset 1
    assert [p.name for p in tmp_path.iterdir()] == [key]  # no temporary directory left


def test_chunked_prefill_stores_in_the_step_that_completes_the_prefix(tmp_path: Path) -> None:
    sched = make_example(tmp_path, KVConnectorRole.SCHEDULER)
    req = make_request("r", list(range(13)))  # aligned prefix 12 = 3 blocks; chunks 5, 5, 3
    sched.update_state_after_alloc(req, [0, 1], 0)
    meta0 = sched.build_connector_meta(sched_out(0, new=[new_req(req, [0, 1])], scheduled={"r": 5}))
    meta1 = sched.build_connector_meta(sched_out(
        1, cached=[CachedRequestRecord("r", [2], 5)], scheduled={"r": 5}))
    meta2 = sched.build_connector_meta(sched_out(
        2, cached=[CachedRequestRecord("r", [3], 10)], scheduled={"r": 3}))
    assert isinstance(meta2, ExampleConnectorMetadata)
    assert meta0 == ExampleConnectorMetadata() and meta1 == ExampleConnectorMetadata()
    assert [(s.num_tokens, s.block_ids) for s in meta2.stores] == [(12, (0, 1, 2))]
    meta3 = sched.build_connector_meta(sched_out(3, cached=[CachedRequestRecord("r", [], 13)],
                                                 scheduled={"r": 1}))
    assert meta3 == ExampleConnectorMetadata()  # stored once


def test_store_is_planned_once_per_prompt_and_only_if_missing(tmp_path: Path) -> None:
    sched = make_example(tmp_path, KVConnectorRole.SCHEDULER)
    a, b = make_request("a", PROMPT), make_request("b", PROMPT)
    sched.update_state_after_alloc(a, [0, 1, 2], 0)
    sched.update_state_after_alloc(b, [3, 4, 5], 0)
    meta = sched.build_connector_meta(sched_out(
        new=[new_req(a, [0, 1, 2]), new_req(b, [3, 4, 5])], scheduled={"a": 11, "b": 11}))
    assert isinstance(meta, ExampleConnectorMetadata)
    assert [s.req_id for s in meta.stores] == ["a"]
    # Once the entry exists nobody stores it again.
    worker_step(make_example(tmp_path, KVConnectorRole.WORKER), meta, make_kv_cache())
    assert admit(sched, make_request("c", PROMPT), [6, 7, 8]).stores == []


def test_a_request_that_ends_or_is_preempted_early_frees_its_plan(tmp_path: Path) -> None:
    sched = make_example(tmp_path, KVConnectorRole.SCHEDULER)
    long_prompt = list(range(13))
    a = make_request("a", long_prompt)
    sched.update_state_after_alloc(a, [0], 0)
    sched.build_connector_meta(sched_out(new=[new_req(a, [0])], scheduled={"a": 4}))
    # Preempted before its prefix was computed: no store; re-admitted: planned again.
    assert sched.build_connector_meta(sched_out(1, preempted=["a"])) == ExampleConnectorMetadata()
    meta = admit(sched, a, [5, 6, 7, 8], step=2)
    assert [(s.req_id, s.block_ids) for s in meta.stores] == [("a", (5, 6, 7))]
    # Aborted mid-prefill: another request with the prompt may plan it right away.
    b, c = make_request("b", long_prompt[:9]), make_request("c", long_prompt[:9])
    sched.update_state_after_alloc(b, [9], 0)
    sched.build_connector_meta(sched_out(3, new=[new_req(b, [9])], scheduled={"b": 4}))
    assert sched.request_finished(b, [9]) == (False, None)
    assert [s.req_id for s in admit(sched, c, [10, 11, 12], step=4).stores] == ["c"]


def test_resent_request_uses_its_full_block_table(tmp_path: Path) -> None:
    sched = make_example(tmp_path, KVConnectorRole.SCHEDULER)
    req = make_request("r", list(range(13)))
    sched.update_state_after_alloc(req, [0], 0)
    sched.build_connector_meta(sched_out(new=[new_req(req, [0])], scheduled={"r": 4}))
    # The engine may resend a running request in full (after a failed load) with new blocks.
    meta = sched.build_connector_meta(sched_out(
        1, new=[new_req(req, [0, 5, 6, 7], num_computed_tokens=4)], scheduled={"r": 9}))
    assert isinstance(meta, ExampleConnectorMetadata)
    assert [s.block_ids for s in meta.stores] == [(0, 5, 6)]


@pytest.mark.parametrize("damage", ["layer file", "manifest", "manifest tokens", "temporary"])
def test_incomplete_entry_is_a_miss(tmp_path: Path, damage: str) -> None:
    key = store(tmp_path, PROMPT, make_kv_cache(), [0, 1, 2])
    entry = tmp_path / key
    if damage == "layer file":
        (entry / f"{layer_name(1)}.safetensors").unlink()
    elif damage == "manifest":
        (entry / MANIFEST).unlink()
    elif damage == "manifest tokens":
        text = (entry / MANIFEST).read_text()
        (entry / MANIFEST).write_text(text.replace('"num_tokens": 8', '"num_tokens": 4'))
    else:  # a crashed save leaves only a hidden temporary directory
        entry.rename(tmp_path / f".tmp-{key[:16]}-crashed")
    sched = make_example(tmp_path, KVConnectorRole.SCHEDULER)
    assert sched.get_num_new_matched_tokens(make_request("r", PROMPT), 0) == (0, False)


def test_damaged_entry_is_stored_again(tmp_path: Path) -> None:
    src = make_kv_cache(seed=4)
    key = store(tmp_path, PROMPT, src, [0, 1, 2])
    (tmp_path / key / f"{layer_name(0)}.safetensors").unlink()
    store(tmp_path, PROMPT, src, [0, 1, 2])  # planned again, and replaces the damaged entry
    assert sorted(p.name for p in tmp_path.iterdir()) == [key]


def test_failed_load_reports_its_blocks_and_writes_nothing(tmp_path: Path) -> None:
    key = store(tmp_path, PROMPT, make_kv_cache(), [0, 1, 2])
    sched, worker = halves(tmp_path)
    req = make_request("r", PROMPT)
    assert sched.get_num_new_matched_tokens(req, 0) == (8, False)
    meta = admit(sched, req, [4, 5, 6], num_external=8)
    (tmp_path / key / f"{layer_name(1)}.safetensors").unlink()  # gone between schedule and load
    dst = make_kv_cache(seed=None)
    assert worker_step(worker, meta, dst)[2] == {4, 5}
    assert torch.count_nonzero(dst) == 0  # layer 0 was readable but is not written either
    assert worker.get_block_ids_with_load_errors() == set()  # reported once


def test_entry_of_another_shape_is_a_load_error(tmp_path: Path) -> None:
    store(tmp_path, PROMPT, make_kv_cache(), [0, 1, 2])
    sched, worker = halves(tmp_path)
    meta = admit(sched, make_request("r", PROMPT), [4, 5, 6], num_external=8)
    wide = torch.zeros(16, 2, 2, BLOCK_SIZE, 2, 5)  # head_dim 5 instead of 3
    assert worker_step(worker, meta, wide)[2] == {4, 5}
    assert torch.count_nonzero(wide) == 0


def test_forward_that_stops_midway_publishes_nothing(tmp_path: Path) -> None:
    sched, worker = halves(tmp_path)
    meta = admit(sched, make_request("r", PROMPT), [0, 1, 2])
    kv = make_kv_cache()
    ctx = ForwardContext(kv, {"r": 11}, 0)
    worker.bind_connector_metadata(meta)
    worker.save_kv_layer(layer_name(0), kv[:, 0], ctx)  # the forward raised after layer 0
    worker.clear_connector_metadata()
    assert list(tmp_path.iterdir()) == []


def test_two_writers_of_one_entry_leave_one_identical_entry(tmp_path: Path) -> None:
    src = make_kv_cache(seed=5)
    sched = make_example(tmp_path, KVConnectorRole.SCHEDULER)
    meta = admit(sched, make_request("r", PROMPT), [0, 1, 2])
    w1, w2 = halves(tmp_path)[1], halves(tmp_path)[1]
    worker_step(w1, meta, src)
    worker_step(w2, meta, src)  # another engine with the same prompt lost the race
    assert len(list(tmp_path.iterdir())) == 1
    other = tmp_path / "other"
    store(other, PROMPT, src, [0, 1, 2])
    key = entry_key(make_request("r", PROMPT))
    cmp = filecmp.dircmp(tmp_path / str(key), other / str(key))
    assert not cmp.left_only and not cmp.right_only and not cmp.diff_files
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / str(key), other / str(key),
                                           os.listdir(other / str(key)), shallow=False)
    assert mismatch == [] and errors == []


def test_kv_role_limits_direction(tmp_path: Path) -> None:
    consumer = make_example(tmp_path, KVConnectorRole.SCHEDULER, kv_role="kv_consumer")
    assert admit(consumer, make_request("a", PROMPT), [0, 1, 2]).stores == []
    store(tmp_path, PROMPT, make_kv_cache(), [0, 1, 2])
    producer = make_example(tmp_path, KVConnectorRole.SCHEDULER, kv_role="kv_producer")
    assert producer.get_num_new_matched_tokens(make_request("b", PROMPT), 0) == (0, False)
    assert consumer.get_num_new_matched_tokens(make_request("c", PROMPT), 0) == (8, False)


def test_metadata_is_plain_data_and_stats_count(tmp_path: Path) -> None:
    sched, worker = halves(tmp_path)
    meta = admit(sched, make_request("r", PROMPT), [0, 1, 2])
    assert pickle.loads(pickle.dumps(meta)) == meta
    kv = make_kv_cache()
    ctx = ForwardContext(kv, {"r": 11}, 0)
    worker.bind_connector_metadata(meta)
    for i in range(kv.shape[1]):
        worker.save_kv_layer(layer_name(i), kv[:, i], ctx)
    assert worker.get_kv_connector_stats() == {"num_stored_tokens": 8}
    assert worker.get_kv_connector_stats() == {}  # counters since the previous call
    worker.clear_connector_metadata()
    assert sched.reset_cache() is None
    assert sched.request_finished(make_request("r", PROMPT), [0]) == (False, None)


@settings(max_examples=50, deadline=None)
@given(src_blocks=st.lists(st.integers(0, 15), min_size=1, max_size=6, unique=True),
       dst_offset=st.integers(0, 9), skip=st.integers(0, 5))
def test_gather_then_scatter_is_identity(src_blocks: list[int], dst_offset: int, skip: int) -> None:
    """Tokens [skip * block_size, ...) of a gathered entry land in the destination blocks exactly
    as they were in the source blocks; every other destination block stays untouched."""
    skip = min(skip, len(src_blocks) - 1)
    src, dst = make_kv_cache(seed=7), make_kv_cache(seed=None)
    dst_blocks = tuple(range(dst_offset, dst_offset + len(src_blocks) - skip))
    for layer in range(src.shape[1]):
        data = gather(src[:, layer], tuple(src_blocks))  # (tokens, 2, kv_heads, head_dim)
        assert data.shape == (len(src_blocks) * BLOCK_SIZE, 2, 2, 3)
        scatter(dst[:, layer], dst_blocks, data[skip * BLOCK_SIZE:])
    assert torch.equal(dst[list(dst_blocks)], src[src_blocks[skip:]])
    others = [b for b in range(dst.shape[0]) if b not in dst_blocks]
    assert torch.count_nonzero(dst[others]) == 0


def test_store_reading_a_block_whose_load_failed_is_dropped(tmp_path: Path) -> None:
    """r loads its prompt into blocks 4, 5; s (a longer prompt with the same first 8 tokens) hits
    them locally in the same step and plans its own store. r's load fails: s's KV was computed
    from garbage and must not become an entry."""
    key = store(tmp_path, PROMPT, make_kv_cache(), [0, 1, 2])
    (tmp_path / key / f"{layer_name(0)}.safetensors").write_bytes(b"torn")
    sched, worker = halves(tmp_path)
    r, s = make_request("r", PROMPT), make_request("s", PROMPT[:8] + list(range(9)))
    sched.update_state_after_alloc(r, [4, 5, 6], 8)
    sched.update_state_after_alloc(s, [4, 5, 7, 8, 9], 0)
    meta = sched.build_connector_meta(sched_out(
        new=[new_req(r, [4, 5, 6], 8), new_req(s, [4, 5, 7, 8, 9], 8)], scheduled={"r": 3, "s": 9}))
    assert isinstance(meta, ExampleConnectorMetadata)
    assert [x.req_id for x in meta.loads] == ["r"] and [x.req_id for x in meta.stores] == ["s"]
    assert worker_step(worker, meta, make_kv_cache())[2] == {4, 5}
    assert sorted(p.name for p in tmp_path.iterdir()) == [key]  # no entry for s
