"""`kvport bench serve`: vLLM's own serving benchmark client (`vllm bench serve`) against
OpenAI-compatible vLLM servers (`python -m kvport.vllm serve`) without a connector and with
kvport's tiers, side by side in one run, on a shared-prefix, a multi-turn and a two-instance
multi-turn workload at one request rate.

    config     scenarios, systems, sizes, each server's pool and kv_transfer_config
    datasets   the datasets as vLLM's client reads them (the multi-turn ShareGPT file)
    prepare    the datasets and the pool, decided before any server starts
    server     one `vllm serve` process: started, awaited on /health, reset, stopped
    client     one `vllm bench serve` run and its saved result
    forwarder  routes the two-instance scenario's requests to the instance of each row
    metrics    the servers' Prometheus counters: where prompt tokens came from
    run        the run: systems one at a time, everything stopped however it ends
    result     the typed result, the ratios, the targets; report: the table; plot: the bars
    cli        the subcommand's flags
"""
