"""The OffloadingConnector's scheduler half (runs in the engine's scheduler): hits, loads and stores
planned as jobs, the jobs' bookkeeping, and the lookups of the tiers below host memory."""
