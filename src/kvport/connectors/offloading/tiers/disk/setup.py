"""Setting up a disk tier's directory: the root created, the namespace directory created or
checked (this user's, writable by nobody else: anyone who can write there can plant entries),
and the file system checked for hard links (every key's name is one)."""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from kvport.connectors.offloading.tiers.disk.location import DiskLocation, unlink_quietly

logger = logging.getLogger("kvport.connectors.offloading.tiers.disk.tier")
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def prepare_directory(location: DiskLocation, root_dir: str | os.PathLike[str],
                      group_access: bool) -> None:
    """`root_dir` created if missing (it must be a directory), and the namespace directory
    created or checked (_secure_dir)."""
    root = Path(root_dir)
    if not root.exists():
        os.makedirs(root, mode=location.dir_mode, exist_ok=True)
    if not root.is_dir():
        raise OSError(errno.ENOTDIR, f"disk tier root_dir {str(root)!r} is not a directory")
    _secure_dir(location.dir, location, group_access)


def _secure_dir(path: Path, location: DiskLocation, group_access: bool) -> None:
    """Create the namespace directory with the tier's mode, or check the one there: a real
    directory (not a symlink) of this user that nobody else may write (group members only
    with group_access); a wider mode of our own directory is narrowed."""
    try:
        path.mkdir(mode=location.dir_mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    where = f"disk tier directory {str(path)!r}"
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, f"{where} is not a directory (a symlink is refused)")
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == os.geteuid():
        if mode & ~location.dir_mode:
            os.chmod(path, location.dir_mode)
            logger.warning("%s had mode %o; set to %o", where, mode, location.dir_mode)
        return
    if not group_access:
        raise PermissionError(errno.EACCES, f"{where} belongs to uid {st.st_uid}, not to "
                              f"this user ({os.geteuid()}); its entries could be planted by "
                              f"that user: use a root_dir of your own, or group_access: "
                              f"true where the directory's group is trusted")
    if mode & stat.S_IWOTH:
        raise PermissionError(errno.EACCES, f"{where} is writable by every user (mode "
                              f"{mode:o}): anyone could plant entries")


def check_hard_links(location: DiskLocation) -> None:
    """Refuse, at construction, a directory whose file system cannot hard-link (FAT, some
    network file systems): every key's name is a link to its run file. A full file system
    (an engine restarted on a full disk) cannot tell: the tier starts, its stores are
    skipped until space frees, and a file system without links fails each one."""
    a = location.temp_path_str()
    b = location.temp_path_str()
    try:
        os.close(os.open(a, CREATE_FLAGS, location.file_mode))
        os.link(a, b)
    except OSError as exc:
        if exc.errno in FULL_DISK:
            logger.warning("disk tier %s: the file system is full (%s); stores are skipped "
                           "until space frees", location.dir, exc)
            return
        raise OSError(exc.errno, f"disk tier root_dir {str(location.dir.parent)!r}: cannot create "
                      f"hard links there ({exc.strerror}); the disk tier names each key by a "
                      f"hard link to its run file: use a directory on ext4, xfs, btrfs or "
                      f"tmpfs") from exc
    finally:
        unlink_quietly(a)
        unlink_quietly(b)
