"""Scheduler side: which keys the disk tier holds. One stat per key (the file system is the
truth, so entries other processes wrote are found, and those they evicted are not); the
scheduler bounds the time it waits for the answer (scheduler/lower_lookup.py)."""

from __future__ import annotations

import os
import stat

from kvport.connectors.offloading.config import DiskTierConfig
from kvport.connectors.offloading.tiers import DroppedKeys
from kvport.connectors.offloading.tiers.disk.location import DiskLocation


class DiskLookup:
    def __init__(self, config: DiskTierConfig, namespace: bytes) -> None:
        self.location = DiskLocation(config.root_dir, namespace, config.group_access)
        self.timeout_s = config.lookup_timeout_ms / 1000.0
        self.absent = DroppedKeys()  # keys found to have no name (for removal events)

    def exists(self, key: bytes) -> bool:
        """Whether the disk tier holds an entry for `key` now (a regular file, not followed
        through a symlink)."""
        try:
            return stat.S_ISREG(os.lstat(self.location.path_str(key)).st_mode)
        except FileNotFoundError:
            self.absent.add([key])
            return False
        except OSError:  # not known to be gone: a miss, not a removal
            return False
