"""HostTier: engine -> host -> engine round trips are byte identities, for every copy strategy."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch
from needs import native_switched_off, require

from kvport.connectors.offloading.mediums import EngineBlocks, HostBlocks
from kvport.connectors.offloading.tiers.host import block_copy
from kvport.connectors.offloading.tiers.host.tier import (
    STRATEGIES,
    HostTier,
    copy_rows,
    plan_pieces,
    row_runs,
)

# (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
SHAPE = (12, 2, 2, 4, 2, 8)


def make_pool(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=gen).to(dtype)


def test_row_runs_merge_consecutive_pairs() -> None:
    assert row_runs([3, 4, 5, 9, 1], [0, 1, 2, 3, 4]) == [(3, 0, 3), (9, 3, 1), (1, 4, 1)]
    assert row_runs([], []) == []


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_copy_rows_strategies_agree(strategy: str) -> None:
    src = torch.arange(40, dtype=torch.uint8).view(10, 4)
    dst = torch.zeros(6, 4, dtype=torch.uint8)
    copy_rows(src, dst, [7, 8, 2, 3, 0], [5, 0, 1, 2, 4], strategy)
    for s, d in zip([7, 8, 2, 3, 0], [5, 0, 1, 2, 4]):
        assert torch.equal(dst[d], src[s])
    assert torch.equal(dst[3], torch.zeros(4, dtype=torch.uint8))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("f", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_into_other_engine_blocks(strategy: str, f: int, dtype: torch.dtype) -> None:
    pool = make_pool(0, dtype)
    host = HostTier.for_pool(pool, num_slots=4, blocks_per_slot=f, strategy=strategy)
    src_ids = [5, 2, 7, 8, 9, 0][: 2 * f]  # two offload blocks, scattered and consecutive ids
    host.store(EngineBlocks(src_ids), HostBlocks([3, 1]))
    before = pool.clone()
    dst_ids = [11, 1, 4, 3, 10, 6][: 2 * f]
    out = host.load(HostBlocks([3, 1]), EngineBlocks(dst_ids))
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(pool[d], before[s])
    untouched = [b for b in range(SHAPE[0]) if b not in dst_ids]
    assert torch.equal(pool[untouched], before[untouched])
    assert out.num_bytes == len(dst_ids) * pool[0].numel() * pool.element_size()
    assert out.failed_indices == []


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_with_partial_first_offload_block(strategy: str) -> None:
    f = 4
    pool = make_pool(1)
    host = HostTier.for_pool(pool, num_slots=2, blocks_per_slot=f, strategy=strategy)
    src_ids = [0, 1, 2, 3, 4, 5, 6, 7]
    host.store(EngineBlocks(src_ids), HostBlocks([1, 0]))
    before = pool.clone()
    # The engine already has the first 3 engine blocks of offload block 0: skip them.
    dst_ids = [11, 8, 9, 10, 2]
    host.load(HostBlocks([1, 0]), EngineBlocks(dst_ids, skip=3))
    for s, d in zip(src_ids[3:], dst_ids):
        assert torch.equal(pool[d], before[s])
    assert torch.equal(pool[:2], before[:2])


def test_bad_shapes_name_the_values() -> None:
    pool = make_pool(2)
    host = HostTier.for_pool(pool, num_slots=2, blocks_per_slot=2)
    with pytest.raises(ValueError, match="needs 4 engine blocks, got 3"):
        host.store(EngineBlocks([0, 1, 2]), HostBlocks([0, 1]))
    with pytest.raises(ValueError, match="skip=2"):
        host.load(HostBlocks([0]), EngineBlocks([], skip=2))
    with pytest.raises(IndexError, match=r"slots \[5\]"):
        host.store(EngineBlocks([0, 1]), HostBlocks([5]))
    with pytest.raises(ValueError, match="not a multiple"):
        HostTier(2, 1000).register_engine_pool(pool)
    with pytest.raises(RuntimeError, match="register_engine_pool"):
        HostTier(2, 1024).store(EngineBlocks([0]), HostBlocks([0]))


def resident_fraction(t: torch.Tensor) -> float:
    """The share of the pages under t's bytes that are in memory now (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    num_pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * num_pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) / num_pages


def test_the_buffer_is_resident_from_the_start() -> None:
    """Every page of the tier is faulted in when it is made, not by the first store into it,
    which runs beside the engine's forward (docs/offloading.md)."""
    host = HostTier(64, 1 << 20)  # above malloc's mmap threshold: fresh pages, none resident
    assert resident_fraction(host.buffer) == 1.0


def test_stats_count_bytes_and_blocks() -> None:
    pool = make_pool(3)
    host = HostTier.for_pool(pool, num_slots=3, blocks_per_slot=2)
    host.store(EngineBlocks([0, 1, 2, 3]), HostBlocks([0, 1]))
    host.load(HostBlocks([1]), EngineBlocks([5], skip=1))
    s = host.stats.snapshot()
    assert (s.blocks_stored, s.bytes_stored) == (2, 2 * host.slot_bytes)
    assert (s.blocks_loaded, s.bytes_loaded) == (1, host.slot_bytes // 2)


@pytest.mark.parametrize("strategy", ["native", "numpy"])
@pytest.mark.parametrize("num_threads", [1, 3])
def test_large_transfers_split_between_threads(num_threads: int, strategy: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # 32 KiB engine blocks, 4 per slot: 48 blocks = 1.5 MiB, above numpy's split threshold
    # (and native's, lowered here: its own is 16 MiB).
    monkeypatch.setattr(block_copy, "_MIN_SPLIT_BYTES", 1 << 20)
    pool = torch.randn(64, 4, 2, 16, 2, 32)
    host = HostTier.for_pool(pool, num_slots=16, blocks_per_slot=4, strategy=strategy,
                             num_threads=num_threads)
    src_ids = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:48].tolist()
    slots = [15, 2, 7, 0, 1, 9, 4, 3, 12, 11, 5, 6]
    host.store(EngineBlocks(src_ids), HostBlocks(slots))
    before = pool.clone()
    dst_ids = list(reversed(range(64)))[:46]
    host.load(HostBlocks(slots), EngineBlocks(dst_ids, skip=2))
    for s, d in zip(src_ids[2:], dst_ids):
        assert torch.equal(pool[d], before[s])


def test_plan_pieces_gathers_into_slots_and_scatters_out_of_them() -> None:
    # A store of two offload blocks (f = 3) from scattered engine blocks: one gather per slot.
    assert plan_pieces([9, 2, 5, 7, 1, 4], [6, 7, 8, 0, 1, 2]) == [(0, 3, 0), (3, 6, 0)]
    # The matching load: one scatter out of each slot; a lone pair is a single copy.
    assert plan_pieces([6, 7, 8, 0], [9, 2, 5, 7]) == [(0, 3, 1), (3, 4, 2)]


# ---- jobs of engine blocks (f = 1), as the connector moves them ---------------------------------

def job_pool(num_blocks: int, seed: int) -> torch.Tensor:
    # 32 KiB engine blocks (tiny-llama's): a job of 48 is 1.5 MiB, above the split threshold
    return torch.randn((num_blocks, 4, 2, 16, 2, 32), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("strategy", ["native", "numpy"])
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("slots", ["consecutive", "runs", "scattered"])
@pytest.mark.parametrize("job", [1, 8, 48])
def test_jobs_of_engine_blocks_are_byte_identities(num_threads: int, slots: str, job: int,
                                                    strategy: str) -> None:
    pool = job_pool(64, seed=job)
    host = HostTier.for_pool(pool, num_slots=64, blocks_per_slot=1, strategy=strategy,
                             num_threads=num_threads)
    gen = torch.Generator().manual_seed(7)
    src_ids = torch.randperm(64, generator=gen)[:job].tolist()  # anywhere in the pool
    slot_ids = {"consecutive": list(range(10, 10 + job)),
                "runs": [s for r in range(0, 60, 6) for s in range(r, r + 5)][:job],  # gaps
                "scattered": torch.randperm(64, generator=gen)[:job].tolist()}[slots]
    before = pool.clone()
    host.store(EngineBlocks(src_ids), HostBlocks(slot_ids))
    for b, s in zip(src_ids, slot_ids):
        assert torch.equal(host.slot(s), before[b].reshape(-1).view(torch.uint8))
    dst_ids = torch.randperm(64, generator=gen)[:job].tolist()
    out = host.load(HostBlocks(slot_ids), EngineBlocks(dst_ids))
    for b, d in zip(src_ids, dst_ids):
        assert torch.equal(pool[d], before[b])
    untouched = [b for b in range(64) if b not in dst_ids]
    assert torch.equal(pool[untouched], before[untouched])
    assert out.num_bytes == job * host.slot_bytes


def test_a_load_into_consecutive_engine_blocks_from_scattered_slots() -> None:
    pool = job_pool(16, seed=3)
    host = HostTier.for_pool(pool, num_slots=16, blocks_per_slot=1)
    host.store(EngineBlocks([3, 9, 1, 12]), HostBlocks([7, 2, 11, 0]))
    before = pool.clone()
    host.load(HostBlocks([7, 2, 11, 0]), EngineBlocks([4, 5, 6, 7]))  # a source-side scatter
    for b, d in zip([3, 9, 1, 12], [4, 5, 6, 7]):
        assert torch.equal(pool[d], before[b])


# ---- the native copy (block_copy.c) ---------------------------------------------------------

@pytest.fixture
def native_block_copy() -> None:
    """block_copy.c must build (every supported machine has a C compiler): a failed build fails
    these tests rather than skipping them, unless native code was switched off on purpose."""
    if native_switched_off():
        pytest.skip("native code switched off on purpose (KVPORT_NATIVE_KERNELS=0)")
    require(block_copy.available(), "block_copy.c did not build (see kvport.native's warning)")


needs_native = pytest.mark.usefixtures("native_block_copy")


@needs_native
@pytest.mark.parametrize("width", [1, 63, 255, 256, 257, 4096 + 40, 100_003])
@pytest.mark.parametrize("offset", [0, 1, 24])
def test_native_copy_of_any_row_width_at_any_address(width: int, offset: int) -> None:
    """Rows too short for streaming stores, rows whose destination starts mid-line and whose
    length is no multiple of a line: every byte lands, and none beside them."""
    gen = torch.Generator().manual_seed(width + offset)
    src = torch.randint(0, 256, (6, width), dtype=torch.uint8, generator=gen)
    buf = torch.zeros(offset + 7 * width + 64, dtype=torch.uint8)
    dst = buf[offset:offset + 7 * width].view(7, width)  # unaligned unless offset is 0
    copy_rows(src, dst, [5, 0, 3, 2], [1, 6, 2, 4], "native")
    for s, d in zip([5, 0, 3, 2], [1, 6, 2, 4]):
        assert torch.equal(dst[d], src[s])
    assert not dst[[0, 3, 5]].any() and not buf[:offset].any() and not buf[offset + 7 * width:].any()


@needs_native
@pytest.mark.parametrize("split", [False, True])
def test_native_copy_refuses_ids_out_of_range_and_writes_nothing(
        split: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if split:  # the bad id is in the helper's half: the whole job is checked before any copy
        monkeypatch.setattr(block_copy, "_MIN_SPLIT_BYTES", 1)
    pool = make_pool(0)
    host = HostTier.for_pool(pool, num_slots=4, blocks_per_slot=1, num_threads=2)
    assert host.strategy == "native"
    before, slots_before = pool.clone(), host.buffer.clone()
    with pytest.raises(IndexError, match=r"engine block 12 <-> host row 1 \(pair 1\): out of "
                                         r"range, the pool has 12 blocks and the tier 4 rows"):
        host.store(EngineBlocks([1, 12]), HostBlocks([0, 1]))
    with pytest.raises(IndexError, match=r"engine block 30 <-> host row 0 \(pair 0\)"):
        host.load(HostBlocks([0]), EngineBlocks([30]))
    with pytest.raises(IndexError, match=r"host row -1"):  # below the tier's own slot checks
        host._native.copy([0], [-1], to_host=True)  # type: ignore[union-attr]
    assert torch.equal(pool, before) and torch.equal(host.buffer, slots_before)
    assert host.store(EngineBlocks([]), HostBlocks([])).num_bytes == 0  # an empty job copies nothing


def test_without_a_compiler_the_tier_copies_with_numpy(
        no_c_compiler: Path, caplog: pytest.LogCaptureFixture) -> None:
    block_copy._library.cache_clear()
    try:
        pool = make_pool(1)
        host = HostTier.for_pool(pool, num_slots=4, blocks_per_slot=1)
        assert "copies with numpy" in caplog.text and not list(no_c_compiler.rglob("*.so"))
        assert host.strategy == "numpy"  # what copies, as the bench reports it
        before = pool.clone()
        host.store(EngineBlocks([7, 2]), HostBlocks([3, 0]))
        host.load(HostBlocks([3, 0]), EngineBlocks([0, 1]))
        assert torch.equal(pool[[0, 1]], before[[7, 2]])
    finally:
        block_copy._library.cache_clear()
