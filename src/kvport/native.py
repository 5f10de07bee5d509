"""C sources built into a shared library on first use and loaded with ctypes.

A library is built with the machine's C compiler (`$CC`, else gcc or cc) into the kvport cache
(`$KVPORT_CACHE_DIR/kernels`, default ~/.cache/kvport/kernels), under a name that hashes the
sources, the flags, the compiler and this CPU's feature flags: the builds use -march=native, so a
cache shared by other machines never hands one a binary it cannot run. ctypes releases the GIL
for every call into it.

Where it cannot be built (no compiler, a failed build), `load` returns None after one warning
that says what the caller does instead. `KVPORT_NATIVE_KERNELS=0` turns every library off.
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
        os.replace(partial, out)


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
    path = default_cache_dir() / "kernels" / f"kvport-{spec.name}-{key.hexdigest()[:16]}.so"
    try:
        if not path.exists():
            _build(spec, compiler, path)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("could not build %s with %s (%s): %s",
                       ", ".join(src.name for src in spec.sources), compiler, detail, spec.without)
        return None
