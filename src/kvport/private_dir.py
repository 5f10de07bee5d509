"""Directories and files only this user can change: where kvport builds and loads native code,
and keeps other per-user state under the shared temp directory.

A directory is private when it is a real directory (not a symlink) owned by this user and not
writable by group or others, and when nobody else can replace it or any directory above it:
every ancestor (of the path as written and of the path it resolves to) belongs to this user or
to root, and is not writable by group or others unless it is a sticky directory owned by root
(as /tmp is: there, only an entry's owner can remove or rename it). A symlink on the way must
belong to this user or to root as well. Anything less lets another local user swap in a shared
library that the engine then runs (or read what it keeps there).

The checks return the reason a path is unsafe (None when it is safe), so a caller can say why it
fell back; `ensure_private_dir` and `user_temp_dir` create what is missing with mode 0o700.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _uid(uid: int | None) -> int:
    return os.getuid() if uid is None else uid


def _prefixes(path: str) -> list[str]:
    """'/a/b/c' -> ['/', '/a', '/a/b'] (the directories above it)."""
    out, head = [], os.path.dirname(path)
    while True:
        out.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            return out[::-1]
        head = parent


def _ancestor_problem(prefix: str, uid: int) -> str | None:
    try:
        link = os.lstat(prefix)
        st = os.stat(prefix)
    except OSError as exc:
        return f"{prefix} cannot be examined ({exc.strerror})"
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (0, uid):
        return f"{prefix} is a symlink owned by uid {link.st_uid}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{prefix} is not a directory"
    if st.st_uid not in (0, uid):
        return f"{prefix} is owned by uid {st.st_uid}"
    if st.st_mode & _OTHERS_WRITE and not (st.st_mode & stat.S_ISVTX and st.st_uid == 0):
        return f"{prefix} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def dir_problem(path: str | os.PathLike[str], uid: int | None = None) -> str | None:
    """Why `path` is not a private directory of user `uid` (default: this process's), or None."""
    uid = _uid(uid)
    lexical = os.path.abspath(os.fspath(path))
    try:
        st = os.lstat(lexical)
    except OSError as exc:
        return f"{lexical} cannot be examined ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return f"{lexical} is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return f"{lexical} is not a directory"
    if st.st_uid != uid:
        return f"{lexical} is owned by uid {st.st_uid}, not {uid}"
    if st.st_mode & _OTHERS_WRITE:
        return f"{lexical} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    resolved = os.path.realpath(lexical)
    # Both chains: a symlink on the written path leads elsewhere, and whoever can change the
    # directory holding that symlink can point it at their own files.
    for prefix in dict.fromkeys(_prefixes(lexical) + _prefixes(resolved)):
        problem = _ancestor_problem(prefix, uid)
        if problem is not None:
            return problem
    return None


def file_problem(path: str | os.PathLike[str], uid: int | None = None) -> str | None:
    """Why `path` is not a file only user `uid` can change (a regular file, not a symlink, owned
    by them, not writable by group or others), or None. Its directory is checked separately."""
    uid = _uid(uid)
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{os.fspath(path)} cannot be examined ({exc.strerror})"
    return fd_stat_problem(os.fspath(path), st, uid)


def fd_stat_problem(name: str, st: os.stat_result, uid: int | None = None) -> str | None:
    """`file_problem` for a file already opened (its fstat, or lstat), named `name`."""
    uid = _uid(uid)
    if stat.S_ISLNK(st.st_mode):
        return f"{name} is a symlink"
    if not stat.S_ISREG(st.st_mode):
        return f"{name} is not a regular file"
    if st.st_uid != uid:
        return f"{name} is owned by uid {st.st_uid}, not {uid}"
    if st.st_mode & _OTHERS_WRITE:
        return f"{name} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def ensure_private_dir(path: str | os.PathLike[str], uid: int | None = None
                       ) -> tuple[Path | None, str | None]:
    """`path`, created (mode 0o700, missing parents too) if absent, and verified private:
    (path, None), or (None, why not). An existing directory is never chmod'ed: one that others
    can write may already hold their files."""
    p = Path(os.path.abspath(Path(path).expanduser()))
    # Each missing directory made 0o700 here (mkdir's parents=True would make them 0o777 less
    # the umask, which a umask of 002 leaves group-writable).
    for missing in [*reversed(p.parents), p]:
        try:
            missing.mkdir(mode=0o700)
        except FileExistsError:
            continue
        except OSError as exc:
            return None, f"{missing} cannot be created ({exc.strerror})"
    problem = dir_problem(p, uid)
    return (None, problem) if problem is not None else (p, None)


def user_temp_path(uid: int | None = None) -> Path:
    """$TMPDIR/kvport-<uid> (the system temp directory where TMPDIR is unset); not created."""
    return Path(tempfile.gettempdir()) / f"kvport-{_uid(uid)}"


def user_temp_dir(*parts: str, uid: int | None = None) -> tuple[Path | None, str | None]:
    """$TMPDIR/kvport-<uid>/<parts...>, created 0o700 and verified (`ensure_private_dir`)."""
    return ensure_private_dir(user_temp_path(uid).joinpath(*parts), uid)


def first_private_dir(candidates: Iterable[str | os.PathLike[str]], uid: int | None = None
                      ) -> tuple[Path | None, list[str]]:
    """The first candidate that is (or, created now, becomes) a private directory, and the
    reasons the candidates before it were refused; (None, reasons) where none is."""
    refused: list[str] = []
    for candidate in candidates:
        path, problem = ensure_private_dir(candidate, uid)
        if path is not None:
            return path, refused
        refused.append(problem or str(candidate))
    return None, refused
