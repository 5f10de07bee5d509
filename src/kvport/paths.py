"""Where kvport keeps what it builds once and reuses: converted models, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """Root of kvport's cache: $KVPORT_CACHE_DIR, else ~/.cache/kvport."""
    root = os.environ.get("KVPORT_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvport"
