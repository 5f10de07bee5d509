"""Mutants of private directories and files (private_dir.py) and native libraries (native.py): each
removes one guard, and the tests named with it must then fail."""

from __future__ import annotations

from tools.mutation import Mutant

NATIVE = "tests/native/test_native.py"
PRIVATE_DIR = "tests/native/test_private_dir.py"


MUTANTS: list[Mutant] = [
    # ---- private directories and files (private_dir.py), native libraries (native.py) ----------
    Mutant(
        "private-dir-owner", "src/kvport/private_dir.py",
        "    if st.st_uid != uid:\n        return f\"{lexical} is owned by uid",
        "    if False:\n        return f\"{lexical} is owned by uid",
        (f"{PRIVATE_DIR}::test_a_directory_of_another_user_is_refused",),
        "a directory of another user is not where native code is built or loaded"),
    Mutant(
        "private-dir-mode", "src/kvport/private_dir.py",
        "    if st.st_mode & _OTHERS_WRITE:\n        return f\"{lexical} is writable",
        "    if False:\n        return f\"{lexical} is writable",
        (f"{PRIVATE_DIR}::"
         "test_a_directory_writable_by_group_or_others_is_refused_and_left_as_it_is",
         f"{NATIVE}::test_a_cache_others_can_write_is_passed_over_for_the_user_temp_dir"),
        "a directory others can write is not where native code is built or loaded (D15)"),
    Mutant(
        "private-dir-symlink", "src/kvport/private_dir.py",
        "    if stat.S_ISLNK(st.st_mode):\n        return f\"{lexical} is a symlink\"\n",
        "",
        (f"{PRIVATE_DIR}::test_a_symlinked_directory_is_refused",),
        "the private directory itself is not a symlink someone could re-point"),
    Mutant(
        "private-dir-parent-mode", "src/kvport/private_dir.py",
        "    if st.st_mode & _OTHERS_WRITE and not (st.st_mode & stat.S_ISVTX and st.st_uid == 0):",
        "    if False:",
        (f"{PRIVATE_DIR}::test_a_parent_others_can_write_is_refused",),
        "a parent others can write lets them swap our directory for theirs"),
    Mutant(
        "private-dir-sticky-needs-root", "src/kvport/private_dir.py",
        "not (st.st_mode & stat.S_ISVTX and st.st_uid == 0):",
        "not (st.st_mode & stat.S_ISVTX):",
        (f"{PRIVATE_DIR}::test_a_parent_others_can_write_is_refused",),
        "only a root-owned sticky parent (/tmp) protects its entries from other users"),
    Mutant(
        "private-dir-parent-owner", "src/kvport/private_dir.py",
        "    if st.st_uid not in (0, uid):\n",
        "    if False:\n",
        (f"{PRIVATE_DIR}::test_a_parent_of_another_user_is_refused",),
        "a parent owned by another user is theirs to rearrange"),
    Mutant(
        "private-dir-resolved-chain", "src/kvport/private_dir.py",
        "_prefixes(lexical) + _prefixes(resolved)",
        "_prefixes(lexical)",
        (f"{PRIVATE_DIR}::test_a_symlink_above_is_checked_both_ways",),
        "the directories a symlinked path resolves to are checked too"),
    Mutant(
        "private-dir-made-0o700", "src/kvport/private_dir.py",
        "            missing.mkdir(mode=0o700)\n",
        "            missing.mkdir()\n",
        (f"{PRIVATE_DIR}::test_a_new_directory_is_made_0o700_with_each_missing_parent",),
        "each directory kvport makes for itself is 0o700, whatever the umask"),
    Mutant(
        "private-file-mode", "src/kvport/private_dir.py",
        "    if st.st_mode & _OTHERS_WRITE:\n        return f\"{name} is writable",
        "    if False:\n        return f\"{name} is writable",
        (f"{NATIVE}::test_a_library_someone_else_could_have_written_is_replaced_not_loaded",),
        "a group- or world-writable library is never loaded"),
    Mutant(
        "private-file-regular", "src/kvport/private_dir.py",
        "    if not stat.S_ISREG(st.st_mode):\n",
        "    if False:\n",
        (f"{NATIVE}::test_a_library_someone_else_could_have_written_is_replaced_not_loaded",),
        "only a regular file is loaded (a FIFO would hang the load)"),
    Mutant(
        "private-file-owner", "src/kvport/private_dir.py",
        "    if st.st_uid != uid:\n        return f\"{name} is owned by uid",
        "    if False:\n        return f\"{name} is owned by uid",
        (f"{PRIVATE_DIR}::test_a_file_is_checked_for_type_owner_and_mode",),
        "a library of another user is never loaded"),
    Mutant(
        "native-checks-the-library", "src/kvport/native.py",
        "    problem = private_dir.file_problem(path)\n    if problem is not None:\n",
        "    problem = private_dir.file_problem(path)\n    if False:\n",
        (f"{NATIVE}::test_a_library_someone_else_could_have_written_is_replaced_not_loaded",),
        "the library is checked right before it is loaded"),
    Mutant(
        "native-private-build-dir", "src/kvport/native.py",
        "    directory, refused = private_dir.first_private_dir(kernel_dir_candidates())\n",
        "    directory, refused = kernel_dir_candidates()[0], []\n",
        (f"{NATIVE}::test_a_cache_others_can_write_is_passed_over_for_the_user_temp_dir",),
        "native code is built and loaded only in a private directory (D15)"),
    Mutant(
        "native-built-0o755", "src/kvport/native.py",
        "        os.chmod(partial, 0o755)",
        "        pass",
        (f"{NATIVE}::test_built_in_the_cache_0o755_in_a_0o700_directory",),
        "a library is built 0o755 whatever the umask"),
]
