"""`kvport bench hybrid-pool`: the KV pool a hybrid model's requests get inside vLLM with
kvport's OffloadingConnector, vLLM's hybrid allocator on (the connector is SupportsHMA: each KV
cache group keeps its own blocks, a sliding-window group only its window) against forced off
(every layer keeps every block), for the same KV memory.

    cli     the subcommand's flags
    run     the two engines (bench.vllm's engine processes), one workload each
    report  the table and the ratio

Each engine reports vLLM's own count of max_model_len requests its pool holds (vLLM's
`get_max_concurrency_for_kv_cache_config`: per group the blocks a request of max_model_len
takes, a sliding group its window plus a prefill chunk), and runs a few requests whose greedy
outputs must be equal. (Filling the pool with real requests was tried: on two cores the token
budget, not the pool, bounds what runs at once, and it took minutes.)
"""
