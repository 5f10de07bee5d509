"""What every benchmark of `kvport bench` shares.

    command   the subcommand's shape: flags parsed into a config, run, table, --json, exit code
    machine   the facts a reader needs to judge a number, and the load other processes added
    models    model files: builtin names resolved, seeded prompts of non-special token ids
    stats     percentiles, ratios and means of what may be missing
    table     plain-text tables
    process   the JSON-lines child process every engine in a process of its own is driven by
    redis     a Redis server given by URL: checked, a client with the tier's settings, and
              exactly the keys a benchmark wrote deleted
"""
