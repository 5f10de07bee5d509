"""C sources built into a shared library on first use and loaded with ctypes.

A library is built with the machine's C compiler (`$CC`, else gcc or cc) into the kvport cache
(`$KVPORT_CACHE_DIR/kernels`, default ~/.cache/kvport/kernels), under a name that hashes the
sources, the flags, the compiler and this CPU's feature flags: the builds use -march=native, so a
cache shared by other machines never hands one a binary it cannot run. ctypes releases the GIL
for every call into it.

Loading a library runs its code in the engine, so it is built and loaded only in a directory
that nobody but this user can change (kvport.private_dir): the cache's `kernels` directory if it
is one, else `$TMPDIR/kvport-<uid>/kernels` (made 0o700). The file itself is checked right
before it is loaded: a regular file (not a symlink) of this user, writable by nobody else.

A file found there that fails those checks is never loaded: it is replaced by a fresh build.
Where a library cannot be built or loaded safely (no compiler, a failed build, no private
directory, a file that cannot be replaced), `load` returns None after one warning that says why and
what the caller does instead. `KVPORT_NATIVE_KERNELS=0` turns every library off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvport import private_dir
from kvport.paths import default_cache_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NativeLibrary:
    name: str  # the file is kvport-<name>-<hash>.so
    sources: tuple[Path, ...]
    compile_flags: tuple[str, ...]
    link_flags: tuple[str, ...]
    without: str  # what the caller does where the library is not built, for the warning


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(spec: NativeLibrary, compiler: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: processes that build at once never load half a file.
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs = [str(Path(tmp) / f"{src.stem}.o") for src in spec.sources]
        partial = Path(tmp) / out.name
        cmds = [[compiler, *spec.compile_flags, "-c", str(src), "-o", obj]
                for src, obj in zip(spec.sources, objs)]
        cmds.append([compiler, *spec.link_flags, *objs, "-o", str(partial), "-lm"])
        for cmd in cmds:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.chmod(partial, 0o755)  # whatever the umask: nobody else may write what we load
        os.replace(partial, out)


def kernel_dir_candidates() -> list[Path]:
    """Where libraries may be built and loaded, in order of preference."""
    return [default_cache_dir() / "kernels", private_dir.user_temp_path() / "kernels"]


class UnsafeLibraryError(OSError):
    """A built library that someone other than this user could have written."""


def _dlopen(path: Path) -> ctypes.CDLL:
    """ctypes.CDLL of `path` once it passed private_dir's file checks (UnsafeLibraryError if
    not). Between the check and the load only this user can swap the file: its directory is
    private. (Not loaded through /proc/self/fd: glibc treats two libraries opened under the
    same descriptor number as one.)"""
    problem = private_dir.file_problem(path)
    if problem is not None:
        raise UnsafeLibraryError(f"refusing to load {path}: {problem}")
    return ctypes.CDLL(str(path))


def load(spec: NativeLibrary) -> ctypes.CDLL | None:
    """The library built from `spec` (built now if this machine has no copy yet), or None."""
    if os.environ.get("KVPORT_NATIVE_KERNELS") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        logger.warning("no C compiler (gcc or $CC): %s", spec.without)
        return None
    key = hashlib.sha256("\0".join(
        [*(src.read_text() for src in spec.sources), *spec.compile_flags, *spec.link_flags,
         compiler, platform.machine(), _cpu_flags()]).encode())
    directory, refused = private_dir.first_private_dir(kernel_dir_candidates())
    if directory is None:
        logger.warning("no private directory to build %s in (%s): %s", spec.name,
                       "; ".join(refused), spec.without)
        return None
    if refused:
        logger.info("building native code in %s: %s", directory, "; ".join(refused))
    path = directory / f"kvport-{spec.name}-{key.hexdigest()[:16]}.so"
    try:
        if not os.path.lexists(path):
            _build(spec, compiler, path)
        try:
            return _dlopen(path)
        except UnsafeLibraryError as exc:
            # Only this user can write the directory, so the file is replaced by a fresh build
            # (os.replace: a new inode, whatever was there); the file refused is never loaded.
            logger.warning("%s; building it again", exc)
            _build(spec, compiler, path)
            return _dlopen(path)
    except UnsafeLibraryError as exc:
        logger.warning("%s: %s", exc, spec.without)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("could not build %s with %s (%s): %s",
                       ", ".join(src.name for src in spec.sources), compiler, detail, spec.without)
        return None
