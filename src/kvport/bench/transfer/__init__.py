"""`kvport bench transfer`: host, disk and Redis tier bandwidth next to plain copies of the same
bytes, at the connector's granularity (offload block = one engine block, jobs of many blocks).

    config      what is measured: the pool cases (geometry x layout), sizes, strategies
    timing      paired rounds, bandwidth, the helper thread baselines run on
    strategies  the bench-only host copy strategies (runs, gather, index, cat)
    host        host tier store/load jobs vs a torch copy
    disk        disk tier loads (warm, cold) and stores vs one sequential file
    one_file    the one-file baselines of the disk rows, and the device's read counters
    redis       Redis tier vs redis-py's own pipelined SET/GET (with a Redis URL)
    rows        the typed rows and result (JSON only when written)
    targets     the targets, met or not
    run         the run; report: the text tables; cli: the subcommand's flags

Absolute numbers on a shared machine mean little: every ratio compares sides measured back to
back in the same round, and the result records the load other processes added.
"""
