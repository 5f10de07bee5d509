"""OffloadingConnector: tiered KV offload (host memory primary, disk below)."""
