"""Benchmarks behind `kvport bench`, one package per subcommand, and what they share (common).

    throughput          engine decode and prefill tokens/s vs transformers and vLLM's CPU build
    connector-overhead  decode tokens/s with connectors that never hit vs none (overhead)
    transfer            host, disk and Redis tier bandwidth vs plain copies of the same bytes
    multi-turn          a multi-turn chat workload: offloading vs the prefix cache (workload)
    long-doc            long documents queried repeatedly: the same (workload)
    soak                a mixed workload killed and restarted; resources over time

vllm holds the engine process every benchmark runs vLLM in. Every benchmark measures its
baselines in the same run as kvport and reports ratios, because absolute numbers on a shared,
noisy machine mean little; results are typed, and JSON only when written (--json).
"""
