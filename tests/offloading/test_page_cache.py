"""page_cache.holds_whole and has_holes: what the page cache holds of a file's range, and the
answer where the kernel cannot tell (the disk tier then reads as if cold)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fault_tiers import drop_page_cache

from kvport.connectors.offloading.tiers.disk import page_cache


def test_a_range_read_is_held_and_one_dropped_is_not(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(64 * page_cache.PAGE))
    fd = os.open(path, os.O_RDONLY)
    try:
        drop_page_cache(path)
        if not page_cache.available():  # a kernel before 6.5: never held, never an error
            assert not page_cache.holds_whole(fd, 0, 4096)
            return
        assert not page_cache.holds_whole(fd, 0, 64 * page_cache.PAGE)
        os.pread(fd, 10 * page_cache.PAGE, 0)
        assert page_cache.holds_whole(fd, 100, 5 * page_cache.PAGE)  # not page-aligned
        os.pread(fd, 64 * page_cache.PAGE, 0)
        assert page_cache.holds_whole(fd, 0, 64 * page_cache.PAGE)
        os.posix_fadvise(fd, 32 * page_cache.PAGE, page_cache.PAGE, os.POSIX_FADV_DONTNEED)
        assert not page_cache.holds_whole(fd, 0, 64 * page_cache.PAGE)  # one page missing
        assert page_cache.holds_whole(fd, 0, 32 * page_cache.PAGE)
        assert not page_cache.holds_whole(fd, 0, 0)
    finally:
        os.close(fd)


def test_a_kernel_without_the_call_holds_nothing(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * page_cache.PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:
        monkeypatch.setattr(page_cache, "_call", None)
        assert not page_cache.holds_whole(fd, 0, page_cache.PAGE)
        assert not page_cache.available()
    finally:
        os.close(fd)


def test_holes_are_pages_missing_between_or_before_cached_ones(tmp_path: Path) -> None:
    """has_holes: some of the range cached, but not as a prefix of it (a sequential reader's
    readahead leaves a prefix: no holes)."""
    page = page_cache.PAGE
    path = tmp_path / "f"
    path.write_bytes(os.urandom(64 * page))
    fd = os.open(path, os.O_RDONLY)

    def cache_all_but(first: int, count: int) -> None:
        os.pread(fd, 64 * page, 0)
        os.posix_fadvise(fd, first * page, count * page, os.POSIX_FADV_DONTNEED)

    try:
        drop_page_cache(path)
        if not page_cache.available():
            assert not page_cache.has_holes(fd, 0, 64 * page)
            return
        assert not page_cache.has_holes(fd, 0, 64 * page)  # nothing cached
        cache_all_but(0, 0)
        assert not page_cache.has_holes(fd, 0, 64 * page)  # all cached
        cache_all_but(32, 32)
        assert not page_cache.has_holes(fd, 0, 64 * page)  # a prefix
        assert page_cache.has_holes(fd, 16 * page, 48 * page) is False  # a prefix of this one
        cache_all_but(16, 8)
        assert page_cache.has_holes(fd, 0, 64 * page)  # a hole in the middle
        assert page_cache.has_holes(fd, 100, 64 * page - 200)  # not page-aligned
        assert not page_cache.has_holes(fd, 0, 16 * page)  # the range before the hole
        cache_all_but(0, 8)
        assert page_cache.has_holes(fd, 0, 64 * page)  # its start missing
        assert not page_cache.has_holes(fd, 0, 0)
    finally:
        os.close(fd)
