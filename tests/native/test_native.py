"""kvport.native builds and loads only where nobody but this user can change the library: the
kvport cache's kernels directory, else $TMPDIR/kvport-<uid>/kernels, else no native code (the
caller's Python path, after a warning). A planted or loosened library is never loaded."""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path

import pytest

from kvport import native
from kvport.connectors.offloading.tiers.host import block_copy
from kvport.model import kernels

WITHOUT = "the probe's caller computes in Python"


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> native.NativeLibrary:
    """A one-function library, a private cache (tmp/cache) and a private temp dir (tmp/tmp)."""
    monkeypatch.delenv("KVPORT_NATIVE_KERNELS", raising=False)
    monkeypatch.setenv("KVPORT_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "tmp").mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    src = tmp_path / "probe.c"
    src.write_text("int kvport_probe(void) { return 42; }\n")
    return native.NativeLibrary("probe", (src,), ("-O1", "-fPIC"), ("-shared",), WITHOUT)


def built(directory: Path) -> list[Path]:
    return sorted(directory.glob("kvport-probe-*.so"))


def test_built_in_the_cache_0o755_in_a_0o700_directory(probe: native.NativeLibrary,
                                                        tmp_path: Path) -> None:
    old = os.umask(0o002)  # the compiler's output would be group-writable: 0o775
    try:
        lib = native.load(probe)
    finally:
        os.umask(old)
    assert lib is not None and lib.kvport_probe() == 42
    kdir = tmp_path / "cache" / "kernels"
    [so] = built(kdir)
    assert stat.S_IMODE(kdir.stat().st_mode) == 0o700
    assert stat.S_IMODE(so.stat().st_mode) == 0o755
    assert not list((tmp_path / "tmp").iterdir())  # nothing in the temp dir
    assert native.load(probe) is not None and built(kdir) == [so]  # reused, not rebuilt


def test_a_cache_others_can_write_is_passed_over_for_the_user_temp_dir(
        probe: native.NativeLibrary, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kdir = tmp_path / "cache" / "kernels"
    kdir.mkdir(parents=True)
    kdir.chmod(0o777)
    (kdir / "planted.so").write_bytes(b"")  # whatever is there stays unread
    with caplog.at_level(logging.INFO, logger="kvport.native"):
        lib = native.load(probe)
    assert lib is not None and lib.kvport_probe() == 42
    assert not built(kdir)
    fallback = tmp_path / "tmp" / f"kvport-{os.getuid()}" / "kernels"
    assert len(built(fallback)) == 1
    assert stat.S_IMODE(fallback.stat().st_mode) == 0o700
    assert stat.S_IMODE(fallback.parent.stat().st_mode) == 0o700
    assert f"{kdir} is writable by group or others" in caplog.text


def test_with_no_private_directory_nothing_native_runs(
        probe: native.NativeLibrary, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache").chmod(0o775)
    theirs = tmp_path / "tmp" / f"kvport-{os.getuid()}"
    theirs.mkdir()
    theirs.chmod(0o777)  # someone made the temp dir's name first
    with caplog.at_level(logging.WARNING, logger="kvport.native"):
        assert native.load(probe) is None
    assert "no private directory to build probe in" in caplog.text and WITHOUT in caplog.text
    assert f"{theirs} is writable by group or others" in caplog.text
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.parametrize("how", ["group-writable", "symlink", "fifo"])
def test_a_library_someone_else_could_have_written_is_replaced_not_loaded(
        probe: native.NativeLibrary, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        how: str) -> None:
    assert native.load(probe) is not None
    [so] = built(tmp_path / "cache" / "kernels")
    real = tmp_path / "elsewhere.so"
    if how == "group-writable":
        so.chmod(0o775)
    else:
        so.rename(real)
        so.symlink_to(real) if how == "symlink" else os.mkfifo(so)
    with caplog.at_level(logging.WARNING, logger="kvport.native"):
        lib = native.load(probe)
    reason = {"group-writable": "is writable by group or others (mode 775)",
              "symlink": "is a symlink", "fifo": "is not a regular file"}[how]
    assert f"refusing to load {so}: {so} {reason}; building it again" in caplog.text
    assert lib is not None and lib.kvport_probe() == 42
    st = so.lstat()  # a fresh build in its place: ours, 0o755, a regular file
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o755
    if how != "group-writable":
        assert real.is_file()  # what the symlink pointed at is left alone


def test_a_refused_library_that_cannot_be_replaced_leaves_the_python_path(
        probe: native.NativeLibrary, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert native.load(probe) is not None
    [so] = built(tmp_path / "cache" / "kernels")
    so.unlink()
    so.mkdir()  # a directory of that name: not a library, and os.replace cannot overwrite it
    with caplog.at_level(logging.WARNING, logger="kvport.native"):
        assert native.load(probe) is None
    assert f"refusing to load {so}: {so} is not a regular file" in caplog.text
    assert "could not build probe.c" in caplog.text and WITHOUT in caplog.text


def test_the_real_libraries_build_here() -> None:
    """Every machine kvport supports has a C compiler (README): the block copy and the model's
    kernels must build, or the suite would silently test the Python paths only."""
    if os.environ.get("KVPORT_NATIVE_KERNELS") == "0":
        pytest.skip("native code switched off on purpose (KVPORT_NATIVE_KERNELS=0)")
    assert block_copy.available(), "block_copy.c did not build (see the warning above)"
    assert kernels.available(), "paged_attention.c / small_matmul.c did not build"
