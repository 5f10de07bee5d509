"""kvport.private_dir: which directories and files only this user can change (owner, mode, the
directories above, sticky /tmp-like parents, symlinks), on real temp directories."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from kvport import private_dir

OTHER = 65534  # nobody


def owned_by_someone_else(*paths: Path) -> int:
    """Make `paths` belong to another user and return the uid to check as. As root they are
    chowned to `nobody`; otherwise the check pretends to be another user (uid + 1), for whom
    everything this test created belongs to someone else."""
    if os.geteuid() == 0:
        for p in paths:
            os.lchown(p, OTHER, -1)
        return 0
    return os.getuid() + 1


def test_a_new_directory_is_made_0o700_with_each_missing_parent(tmp_path: Path) -> None:
    old = os.umask(0o002)  # a umask that would leave mkdir's parents group-writable
    try:
        path, problem = private_dir.ensure_private_dir(tmp_path / "a" / "b" / "kernels")
    finally:
        os.umask(old)
    assert problem is None and path == tmp_path / "a" / "b" / "kernels"
    for p in (tmp_path / "a", tmp_path / "a" / "b", path):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700
    assert private_dir.dir_problem(path) is None


@pytest.mark.parametrize("mode", [0o770, 0o702, 0o777, 0o720])
def test_a_directory_writable_by_group_or_others_is_refused_and_left_as_it_is(
        tmp_path: Path, mode: int) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(mode)
    problem = private_dir.dir_problem(d)
    assert problem is not None and f"{d} is writable by group or others" in problem
    assert private_dir.ensure_private_dir(d) == (None, problem)
    assert stat.S_IMODE(d.stat().st_mode) == mode  # never chmod'ed: it may hold others' files


def test_readable_by_others_is_fine(tmp_path: Path) -> None:
    d = tmp_path / "cache"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    assert private_dir.dir_problem(d) is None


def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    uid = owned_by_someone_else(d)
    problem = private_dir.dir_problem(d, uid)
    assert problem is not None and "owned by uid" in problem


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_parent_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    """They could rename our directory away and put theirs in its place; sticky protects only
    where root owns the parent (the parent here is ours, as a sticky /tmp of a user would be)."""
    parent = tmp_path / "open"
    child = parent / "kernels"
    child.mkdir(parents=True, mode=0o700)
    parent.chmod(mode)
    uid = None
    if mode & stat.S_ISVTX and os.geteuid() == 0:  # as root our parent would be root's: give it
        os.chown(parent, OTHER, -1)  # away and check as its owner
        os.chown(child, OTHER, -1)
        uid = OTHER
    problem = private_dir.dir_problem(child, uid)
    assert problem is not None and problem.startswith(f"{parent} is writable by group or others")


def test_a_parent_of_another_user_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "theirs"
    child = parent / "mine"
    child.mkdir(parents=True, mode=0o700)
    parent.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(parent, OTHER, -1)
        problem = private_dir.dir_problem(child)
        assert problem == f"{parent} is owned by uid {OTHER}"
    else:  # checked as another user, the first directory above that is not root's is refused
        problem = private_dir.dir_problem(child, os.getuid() + 1)
        assert problem is not None and "owned by uid" in problem


def test_the_system_temp_directory_is_a_fine_parent() -> None:
    """/tmp: world-writable, sticky and root's; only an entry's owner can rename it there."""
    tmp = Path(tempfile.gettempdir())
    st = tmp.stat()
    assert st.st_uid == 0 and st.st_mode & stat.S_ISVTX, f"{tmp} is not a sticky root dir"
    path, problem = private_dir.user_temp_dir("test-private-dir")
    assert problem is None and path == tmp / f"kvport-{os.getuid()}" / "test-private-dir"
    path.rmdir()


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    assert private_dir.dir_problem(link) == f"{link} is a symlink"
    assert private_dir.dir_problem(real) is None


def test_a_symlink_above_is_checked_both_ways(tmp_path: Path) -> None:
    """Through a symlink: the link's owner, and the directories of the path it resolves to."""
    real = tmp_path / "real"
    (real / "deep" / "kernels").mkdir(parents=True, mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real / "deep")
    assert private_dir.dir_problem(link / "kernels") is None  # ours all the way
    real.chmod(0o777)  # only on the resolved path: real/deep/kernels
    problem = private_dir.dir_problem(link / "kernels")
    assert problem is not None and problem.startswith(f"{real} is writable by group or others")
    real.chmod(0o700)
    assert private_dir.dir_problem(link / "kernels") is None
    if os.geteuid() == 0:
        os.lchown(link, OTHER, -1)
        assert private_dir.dir_problem(link / "kernels") == \
            f"{link} is a symlink owned by uid {OTHER}"


def test_a_file_is_checked_for_type_owner_and_mode(tmp_path: Path) -> None:
    f = tmp_path / "lib.so"
    f.write_bytes(b"\x7fELF")
    f.chmod(0o755)
    assert private_dir.file_problem(f) is None
    f.chmod(0o775)
    assert private_dir.file_problem(f) == f"{f} is writable by group or others (mode 775)"
    f.chmod(0o757)
    assert "writable by group or others" in (private_dir.file_problem(f) or "")
    f.chmod(0o755)
    link = tmp_path / "link.so"
    link.symlink_to(f)
    assert private_dir.file_problem(link) == f"{link} is a symlink"
    fifo = tmp_path / "fifo.so"
    os.mkfifo(fifo)
    assert private_dir.file_problem(fifo) == f"{fifo} is not a regular file"
    uid = owned_by_someone_else(f)
    assert "owned by uid" in (private_dir.file_problem(f, uid) or "")
    assert "cannot be examined" in (private_dir.file_problem(tmp_path / "absent") or "")


def test_the_first_acceptable_candidate_wins_and_the_refusals_say_why(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    blocked = tmp_path / "file"
    blocked.write_text("")
    path, refused = private_dir.first_private_dir(
        [shared / "kernels", blocked / "kernels", tmp_path / "good"])
    assert path == tmp_path / "good"
    assert refused[0].startswith(f"{shared} is writable by group or others")
    assert refused[1].startswith(f"{blocked / 'kernels'} cannot be created")
    assert private_dir.first_private_dir([shared]) == (None, [private_dir.dir_problem(shared)])
