"""`kvport bench multi-turn` and `kvport bench long-doc`: one workload, several configurations
(no connector, the OffloadingConnector's tiers, an ideal cache), side by side in one run.

    workloads    the two workloads: seeded generators, cut in phases
    config       the run's config, the configurations, the default model and sizes
    plan         the engines sized from the workload; each configuration's connector config
    serving      the closed-loop client over kvport's engine; a request as measured
    vllm_runner  the same client over a vLLM engine process
    engines      a pass's engines started, their outcomes collected, shut down
    passes       the Williams orders of phases; several passes pooled
    run          the run: passes, the equality guard, the result
    summary      one configuration's figures
    targets      the targets and their verdicts
    result       the typed result and its JSON
    redis_keys   the Redis keys of redis-cold-host, deleted after a pass
    report       the terminal tables; plot: TTFT per round or query
    cli          the subcommands' flags
"""
