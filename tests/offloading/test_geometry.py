"""OffloadGeometry: one record of the offload block layout, built from (config, spec), the same
in both halves of an engine's connector."""

from __future__ import annotations

import pytest

from kvport.connectors.base import KVCacheSpec
from kvport.connectors.offloading.config import OffloadingConfig
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.connectors.offloading.geometry import tier_namespace
from offload_utils import make_llm, offload_config, offloading_half, worker_half

SPEC = KVCacheSpec(num_blocks=64, block_size=16, num_layers=2, num_kv_heads=2, head_dim=64,
                   dtype="float32", layout="blocks-layers-kv-tokens-heads-dim", hash_root=b"r")


def test_build_derives_every_number_once() -> None:
    assert SPEC.block_bytes == 32 << 10
    g = OffloadGeometry.build(OffloadingConfig(cpu_bytes_to_use=10 << 20), SPEC)
    # The default offload block: the engine's own block.
    assert (g.block_size, g.block_factor, g.offload_tokens) == (16, 1, 16)
    assert (g.slot_bytes, g.num_slots) == (32 << 10, 320)
    assert g.namespace == tier_namespace(b"r", SPEC, 16)
    g = OffloadGeometry.build(OffloadingConfig(cpu_bytes_to_use=200 << 10, block_size=32), SPEC)
    assert (g.block_factor, g.offload_tokens, g.slot_bytes, g.num_slots) == (2, 32, 64 << 10, 3)
    assert g.keys([b"a", b"b", b"c", b"d", b"e"]) == [b"b", b"d"]


def test_a_host_tier_smaller_than_one_offload_block_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"cpu_bytes_to_use=1000 is smaller than one offload "
                                         r"block \(32768 bytes\)"):
        OffloadGeometry.build(OffloadingConfig(cpu_bytes_to_use=1000, block_size=16), SPEC)


def test_both_halves_of_an_engine_hold_the_same_geometry() -> None:
    llm = make_llm(offload_config())
    scheduler_side, worker_side = offloading_half(llm).geometry, worker_half(llm).geometry
    assert scheduler_side == worker_side and scheduler_side is not worker_side
    assert worker_side.num_slots == worker_half(llm).host.num_slots


def test_a_configured_namespace_separates_the_shared_tiers_entries() -> None:
    """`namespace` (kvport's engine and vLLM alike): engines with different ones never share
    disk or Redis entries; without it the namespace is the derived one, unchanged."""
    def ns(**kw: object) -> bytes:
        config = OffloadingConfig(cpu_bytes_to_use=1 << 20, **kw)  # type: ignore[arg-type]
        return OffloadGeometry.build(config, SPEC).namespace

    assert ns() == tier_namespace(b"r", SPEC, 16)
    assert ns(namespace="team-a") == ns(namespace="team-a")
    assert len({ns(), ns(namespace="team-a"), ns(namespace="team-b")}) == 3
