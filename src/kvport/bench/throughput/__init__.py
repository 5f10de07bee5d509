"""`kvport bench throughput`: decode and prefill tokens/s of kvport's engine next to transformers'
`generate` and vLLM's CPU build, on the same model files, dtype and thread count, in one run.

    config   what is measured (ThroughputConfig) and the timed tasks
    systems  the System protocol, timing a list of tasks, kvport's LLM as a system
    hf       transformers' generate as a system
    vllm     vLLM in a process of its own as a system (bench.vllm.server)
    floors   the ceilings this machine sets a decode step and a prefill
    run      systems started, warmed up and measured interleaved; the typed result
    report   the text table
    cli      the subcommand's flags
"""
