"""The Redis keys `redis-cold-host` wrote under a run's own random tenant salt, deleted after the
pass (SCAN and DEL of the run's key prefix alone: never a FLUSH; the prefix holds a digest of the
random salt, so no other data matches it)."""

from __future__ import annotations

import logging

from kvport.bench.common.command import JsonObject
from kvport.bench.common.redis import delete_matching, redis_client
from kvport.bench.workload.config import REDIS_COLD, WorkloadBenchConfig
from kvport.bench.workload.engines import Run
from kvport.bench.workload.plan import BENCH_SALT_PREFIX, ConfigSpec

logger = logging.getLogger(__name__)


def run_redis_keys(cfg: WorkloadBenchConfig, run: Run) -> tuple[str, bytes] | None:
    """(URL, key prefix) of the keys redis-cold-host wrote under the run's random tenant salt,
    for a kvport engine (the namespace digest is its connector's); None for every other
    configuration (a `user` config's Redis keys are never touched), for a salt that was given
    (it may be meant to last), and for vLLM engines (in another process)."""
    if run.spec.name != REDIS_COLD or cfg.redis_tenant_salt is not None:
        return None
    tier = redis_tier_entry(run.spec)
    salt = str((tier or {}).get("tenant_salt", ""))
    if not (salt.startswith(BENCH_SALT_PREFIX) and len(salt) == len(BENCH_SALT_PREFIX) + 16):
        return None  # not a salt build_config_specs drew: not ours to delete
    try:  # kvport's engine: LLM -> engine -> scheduler -> OffloadingConnector -> its lookup
        runner = run.runner
        connector = runner.llm.engine.scheduler.connector  # type: ignore[attr-defined]
        lookup = connector.scheduler_half.lower.redis
    except AttributeError:  # a vLLM runner has no `llm`
        return None
    if tier is None or lookup is None:  # (tier: checked above; for mypy)
        return None
    return str(tier["url"]), bytes(lookup.keyspace.prefix)


def redis_tier_entry(spec: ConfigSpec) -> JsonObject | None:
    """The Redis tier entry of a configuration's kv_transfer_config, if it has one."""
    extra = (spec.kv_transfer_config or {}).get("kv_connector_extra_config") or {}
    return next((t for t in extra.get("secondary_tiers") or [] if t.get("type") == "redis"),
                None)


def delete_redis_keys(ours: list[tuple[str, bytes]]) -> int | None:
    """Delete every key under each (URL, prefix); how many (None: nothing to delete)."""
    if not ours:
        return None
    import redis

    deleted = 0
    for url, prefix in ours:
        client = redis_client(url)
        try:
            deleted += delete_matching(client, prefix + b"*")
        except redis.RedisError as exc:  # the run's numbers stand; the keys stay (Redis evicts)
            logger.warning("could not delete the run's Redis keys: %s", exc)
        finally:
            client.close()
    return deleted
