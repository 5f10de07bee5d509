"""`kvport conformance`: generated workloads on vLLM's CPU build against a connector, each
recorded and checked by kvport's trace checker; a broken rule is shrunk to its shortest workload
and written out as a self-contained reproduction script."""
