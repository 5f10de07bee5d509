"""Where the disk tier's entries live: its namespace, its directory, and the names in it.

The disk tier keeps a job's entries in one run file (tiers/disk/runs.py), named once per key by
a hard link at `DiskLocation.path(key)`.

"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvport.connectors.offloading.tiers.value_format import checksum, key_digest  # noqa: F401

logger = logging.getLogger("kvport.connectors.offloading.tiers.disk.tier")
SUFFIX = ".kvb"
TEMP_PREFIX = ".run."
TEMP_SUFFIX = ".tmp"



def check_pairs(src: list[int] | list[bytes], dst: list[int] | list[bytes]) -> None:
    if len(src) != len(dst):
        raise ValueError(f"source has {len(src)} blocks, destination {len(dst)}")


def unlink_quietly(path: str | os.PathLike[str]) -> None:
    """Remove a file; one already gone is fine, any other failure is logged."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        logger.warning("disk tier could not remove %s", path, exc_info=True)


@dataclass(frozen=True)
class ScannedName:
    """A key's name found on disk, and the run file it links to."""

    key: bytes
    inode: int  # the run file's: shared by the names of one run
    size: int
    mtime_ns: int


@dataclass
class Scan:
    """What listing the directory found: keys' names, and the run files being written by live
    writers (inode -> size; a crashed writer's are removed)."""

    names: list[ScannedName] = field(default_factory=list)
    writing: dict[int, int] = field(default_factory=dict)
    swept: int = 0  # temp files of dead writers (or older than the stale age) removed
    rejected: int = 0  # symlinks in place of a key directory, removed


def modes(group_access: bool) -> tuple[int, int]:
    """(file mode, directory mode): private to the user, or readable by the group too."""
    return (0o640, 0o750) if group_access else (0o600, 0o700)


def _host_tag() -> str:
    return "".join(c if c.isalnum() or c == "-" else "-" for c in socket.gethostname())[:64]


class DiskLocation:
    """Where a disk tier's entries live: `<root>/<namespace digest hex[:16]>/<key hex[:2]>/<key
    hex>.kvb`, each a hard link to the run file holding the key's entry. The scheduler half uses it
    alone, as a read-only view of the directory (the worker's DiskTier writes and evicts, so a
    name's existence is the truth). A name that is not a regular file (a symlink, a FIFO) is
    never a key's entry."""

    def __init__(self, root_dir: str | os.PathLike[str], namespace: bytes,
                 group_access: bool = False) -> None:
        self.namespace_digest = hashlib.sha256(namespace).digest()
        self.dir = Path(root_dir) / self.namespace_digest.hex()[:16]
        self.file_mode, self.dir_mode = modes(group_access)
        self._dir = str(self.dir)
        self._temps = itertools.count()
        self._host = _host_tag()

    def path(self, key: bytes) -> Path:
        return Path(self.path_str(key))

    def path_str(self, key: bytes) -> str:
        """path(key) as a str: 0.6 us instead of pathlib's 5.7 (a load or store builds one per
        entry)."""
        h = key.hex()
        return f"{self._dir}/{h[:2]}/{h}{SUFFIX}"

    def temp_path_str(self) -> str:
        """A fresh name for a run file being written (this host, process and thread): it gets
        its keys' names once it is whole, and loses this one then. The pid lets a later process
        on this host remove it once its writer is dead."""
        return (f"{self._dir}/{TEMP_PREFIX}{self._host}.{os.getpid()}.{threading.get_ident()}."
                f"{next(self._temps)}{TEMP_SUFFIX}")

    def exists(self, key: bytes) -> bool:
        """Whether key's name is a regular file (not following a symlink)."""
        try:
            return stat.S_ISREG(os.lstat(self.path_str(key)).st_mode)
        except OSError:
            return False

    def scan(self, stale_temp_seconds: float) -> Scan:
        """Every key's name under the directory, by name and stat alone (no file is read).
        Temp files of writers on this host that are no longer alive, and any older than
        `stale_temp_seconds` (live writers finish far sooner), are removed."""
        now = time.time()
        out = Scan()
        for entry in os.scandir(self._dir):
            if entry.is_symlink():
                # Never ours: through a symlink at a key directory loads would read, and
                # stores link, outside the directory (O_NOFOLLOW guards the last name only).
                logger.warning("disk tier: %s is a symlink; removed", entry.path)
                unlink_quietly(entry.path)
                out.rejected += 1
            elif entry.is_dir(follow_symlinks=False):
                for name in os.scandir(entry.path):
                    self._scan_name(name, now, stale_temp_seconds, out)
            else:
                self._scan_name(entry, now, stale_temp_seconds, out)
        return out

    def _scan_name(self, entry: os.DirEntry[str], now: float, stale_temp_seconds: float,
                   out: Scan) -> None:
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                return  # a directory, symlink or FIFO: never an entry of ours
            if entry.name.startswith(TEMP_PREFIX) and entry.name.endswith(TEMP_SUFFIX):
                if now - st.st_mtime > stale_temp_seconds or self._writer_dead(entry.name):
                    os.unlink(entry.path)
                    out.swept += 1
                else:
                    out.writing[st.st_ino] = st.st_size
            elif entry.name.endswith(SUFFIX):
                key = bytes.fromhex(entry.name[:-len(SUFFIX)])
                out.names.append(ScannedName(key, st.st_ino, st.st_size, st.st_mtime_ns))
        except (OSError, ValueError):
            pass  # removed meanwhile, or a foreign name: not ours

    def _writer_dead(self, name: str) -> bool:
        """Whether the temp file's writer (its host and pid are in its name) is a process of this
        host that no longer runs. Another host's, or one this process cannot tell, is left to the
        age rule."""
        parts = name[len(TEMP_PREFIX):-len(TEMP_SUFFIX)].split(".")
        if len(parts) != 4 or parts[0] != self._host or not parts[1].isdigit():
            return False
        pid = int(parts[1])
        if pid == os.getpid():
            return False  # another tier of this process may be writing it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # alive, another user's
            return False
        return False
