"""A request's own limits (kv_transfer_params: max_load_tokens, max_offload_tokens,
kv_load_tiers, kv_store_tiers) in kvport's engine with the OffloadingConnector: each honoured,
output unchanged, other requests unaffected; a bad value fails only its request."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from kvport import SamplingParams
from kvport.connectors.offloading.geometry import offload_keys
from kvport.connectors.transfer_params import NO_LIMITS, NOTHING, TransferLimits
from kvport.engine.hashing import hash_blocks
from kvport.engine.llm import LLM
from offload_utils import (
    BLOCK_SIZE, GREEDY, OFFLOAD_BLOCK, assert_nothing_leaked, host_metrics, make_llm,
    offload_config, offloading_half, prompts, run,
)
from view_records import ViewRequest


def limited(**params: Any) -> SamplingParams:
    return dataclasses.replace(GREEDY, extra_args={"kv_transfer_params": params})


def stored_keys(llm: LLM, prompt: list[int]) -> list[bool]:
    """Per offload block of the prompt: whether the host tier holds it."""
    hashes: list[bytes] = []
    hash_blocks(llm.engine.hash_root, prompt, BLOCK_SIZE, hashes)
    manager = offloading_half(llm).manager
    return [manager.lookup([k]) == 1 for k in offload_keys(hashes, OFFLOAD_BLOCK // BLOCK_SIZE)]


def test_max_load_tokens_caps_a_hit_at_a_block_boundary(reference: list[list[int]]) -> None:
    llm = make_llm(offload_config())
    ps = prompts()[:2]
    run(llm, ps)
    llm.reset_prefix_cache()  # the engine's own cache: every hit is the connector's
    tokens, cached = run(llm, ps[1:], limited(max_load_tokens=0))
    assert tokens == reference[1:2] and cached == [0]
    llm.reset_prefix_cache()
    tokens, cached = run(llm, ps[:1], limited(max_load_tokens=20))
    assert tokens == reference[:1] and cached == [16]  # 20 tokens: two whole 8-token blocks
    assert host_metrics(llm)["num_limited_hits"] == 2
    assert_nothing_leaked(llm)


def test_max_offload_tokens_stores_only_the_first_tokens(reference: list[list[int]]) -> None:
    llm = make_llm(offload_config())
    p, q = prompts()[0], prompts()[2]
    assert run(llm, [p, q], [limited(max_offload_tokens=24), GREEDY])[0] == [reference[0],
                                                                           reference[2]]
    assert stored_keys(llm, p) == [True] * 3 + [False] * 4
    assert all(stored_keys(llm, q))  # the other request stores all it computed
    assert run(llm, [p], limited(max_offload_tokens=0))[0] == [reference[0]]
    assert_nothing_leaked(llm)


def test_load_tiers_choose_where_a_hit_may_come_from(tmp_path: Path,
                                                     reference: list[list[int]]) -> None:
    llm = make_llm(offload_config(disk_dir=tmp_path))
    p = prompts()[0]
    run(llm, [p])
    llm.reset_prefix_cache()
    assert run(llm, [p], limited(kv_load_tiers=["disk"]))[1] == [0]  # the host holds it
    llm.reset_prefix_cache()
    assert run(llm, [p], limited(kv_load_tiers=[{"medium": "CPU"}])) == ([reference[0]], [56])
    llm.reset_prefix_cache(reset_connector=True)  # only the disk holds it now
    assert run(llm, [p], limited(kv_load_tiers=["host", "redis"]))[1] == [0]
    llm.reset_prefix_cache(reset_connector=True)
    assert run(llm, [p], limited(kv_load_tiers=[{"medium": "STORAGE", "locality": "LOCAL"}])
               ) == ([reference[0]], [56])
    assert_nothing_leaked(llm)


def test_store_tiers_keep_a_request_off_the_shared_tiers(tmp_path: Path,
                                                         reference: list[list[int]]) -> None:
    llm = make_llm(offload_config(disk_dir=tmp_path))
    p, q = prompts()[0], prompts()[2]
    assert run(llm, [p, q], [limited(kv_store_tiers=["host"]), limited(kv_store_tiers=[])]
               )[0] == [reference[0], reference[2]]
    assert all(stored_keys(llm, p)) and not any(stored_keys(llm, q))
    disk = offloading_half(llm).lower.disk
    assert disk is not None
    hashes: list[bytes] = []
    hash_blocks(llm.engine.hash_root, p, BLOCK_SIZE, hashes)
    assert not any(disk.exists(k) for k in offload_keys(hashes, OFFLOAD_BLOCK // BLOCK_SIZE))
    assert_nothing_leaked(llm)


@pytest.mark.parametrize("params, named", [
    ({"max_load_tokens": -1}, "max_load_tokens"),
    ({"max_offload_tokens": "12"}, "max_offload_tokens"),
    ({"max_load_tokens": True}, "max_load_tokens"),
    ({"kv_load_tiers": "disk"}, "kv_load_tiers"),
    ({"kv_load_tiers": ["tape"]}, "'tape'"),
    ({"kv_load_tiers": [{"medium": "GPU"}]}, "'GPU'"),
    ({"kv_load_tiers": [{"locality": "MARS"}]}, "'MARS'"),
    ({"kv_load_tiers": [{"tier": "disk"}]}, "kv_load_tiers"),
    ({"kv_store_tiers": ["disk"]}, "kv_store_tiers must name host"),
])
def test_a_bad_value_is_an_error_naming_it(params: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        limited(**params)
    with pytest.raises(ValueError, match="kv_transfer_params must be a dict"):
        SamplingParams(extra_args={"kv_transfer_params": [1]})


def test_parsing_leaves_other_connectors_keys_and_names_tiers_both_ways() -> None:
    assert TransferLimits.parse(None) is NO_LIMITS
    assert TransferLimits.parse({"do_remote_prefill": True}) is NO_LIMITS
    both = TransferLimits.parse({"kv_load_tiers": [{"medium": "STORAGE"}], "max_load_tokens": 0})
    assert both.load_tiers == {"DISK", "REDIS"} and both.max_load_tokens == 0
    remote = TransferLimits.parse({"kv_load_tiers": [{"locality": "remote"}, "Host"]})
    assert remote.load_tiers == {"REDIS", "HOST"}
    assert TransferLimits.parse({"kv_load_tiers": []}).load_tiers == frozenset()
    assert not TransferLimits.parse({"kv_store_tiers": []}).stores


def test_a_request_the_connector_cannot_read_neither_loads_nor_stores(
        reference: list[list[int]]) -> None:
    """Where the engine cannot refuse a request (vLLM), the connector runs it untouched."""
    llm = make_llm(offload_config())
    half = offloading_half(llm)
    p = prompts()[0]
    run(llm, [p])
    hashes: list[bytes] = []
    hash_blocks(llm.engine.hash_root, p, BLOCK_SIZE, hashes)
    bad = ViewRequest("bad", p, BLOCK_SIZE, hashes, kv_transfer_params={"max_load_tokens": "x"})
    assert half.get_num_new_matched_tokens(bad, 0) == (0, False)
    assert half._limits.of(bad) is NOTHING
    assert half.stats.num_bad_transfer_params == 1
    good = ViewRequest("good", p, BLOCK_SIZE, hashes)
    assert half.get_num_new_matched_tokens(good, 0)[0] == 56
    half._limits.forget("bad")
    assert run(llm, [p])[0] == reference[:1]
    assert_nothing_leaked(llm)
