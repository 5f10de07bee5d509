"""vLLM's CPU build as an engine of the benchmarks, one engine per process.

    server  the one script that runs in vLLM's interpreter (standard library and vLLM only)
    engine  the client: starts a server, waits for it, calls it (common.process's JSON lines)
"""
