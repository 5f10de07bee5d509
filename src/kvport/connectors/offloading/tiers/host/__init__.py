"""The host tier (worker side): preallocated slots in host memory, and the copies between them and
the engine's KV pool (native C, numpy fallback)."""
