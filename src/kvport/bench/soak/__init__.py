"""`kvport bench soak`: a mixed workload with periodic kill -9 and restart; resources over time.

    run           the soak: the workload process started, sampled, killed and restarted
    child         the workload process (python -m kvport.bench.soak.child)
    process       a workload process seen from the soak: its report lines, its life
    probe         what is sampled: a process's resources, the disk root, Redis
    redis_server  the soak's own redis-server, when no URL is given
    reference     every answer again, without a connector
    result        the typed result and the bounds checked; report: the text table
    cli           the subcommand's flags
"""
