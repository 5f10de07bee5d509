"""`kvport bench connector-overhead`: decode tokens/s of an engine with connectors that never
hit next to the same engine without one, in kvport's engine or inside vLLM (`engine`).

    config  the one config (`engine` kvport or vllm) and the typed result
    rounds  the rotated rounds both engines are timed in
    kvport  four kvport engines in this process
    vllm    two vLLM engine processes (bench.vllm)
    run     the run of the config's engine
    report  the text table
    cli     the subcommand's flags
"""
