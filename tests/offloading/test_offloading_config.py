"""OffloadingConnector configuration and offload-block arithmetic."""

from __future__ import annotations

import dataclasses

import pytest

from kvport.config import KVTransferConfig
from kvport.connectors.factory import parse_extra_config
from kvport.connectors.offloading.config import DiskTierConfig, OffloadingConfig, RedisTierConfig
from kvport.connectors.offloading.geometry import block_factor, offload_keys
from kvport.engine.hashing import hash_blocks, namespace_hash


def parse(extra: dict[str, object]) -> OffloadingConfig:
    return parse_extra_config(OffloadingConfig, KVTransferConfig("OffloadingConnector",
                                                                 kv_connector_extra_config=extra))


def test_vllm_names_parse() -> None:
    cfg = parse({"cpu_bytes_to_use": 1 << 30, "block_size": 64, "eviction_policy": "arc",
                 "store_threshold": 2,
                 "secondary_tiers": [{"type": "disk", "root_dir": "/tmp/x", "max_bytes": 10**9}]})
    assert cfg.secondary_tiers == (DiskTierConfig("/tmp/x", 10**9),)
    assert cfg.disk_tier == DiskTierConfig("/tmp/x", 10**9)
    assert (cfg.eviction_policy, cfg.store_threshold, cfg.block_size) == ("arc", 2, 64)


@pytest.mark.parametrize("extra, message", [
    ({}, "cpu_bytes_to_use must be a positive"),
    ({"cpu_bytes_to_use": 1, "eviction_policy": "fifo"}, "eviction_policy must be one of"),
    ({"cpu_bytes_to_use": 1, "host_copy": "cuda"},
     r"host_copy must be one of \('auto', 'native', 'numpy', 'torch'\), got 'cuda'"),
    ({"cpu_bytes_to_use": 1, "store_threshold": -1}, "store_threshold must be an integer >= 0, got -1"),
    ({"cpu_bytes_to_use": 1, "block_size": 0}, "block_size must be a positive integer, got 0"),
    ({"cpu_bytes_to_use": 1, "inflight_wait_s": -0.5},
     r"inflight_wait_s must be a number >= 0 and below 3600, got -0.5"),
    ({"cpu_bytes_to_use": 1, "inflight_wait_s": float("nan")}, r"inflight_wait_s .* got nan"),
    ({"cpu_bytes_to_use": 1, "inflight_wait_s": "1s"}, r"inflight_wait_s"),
    ({"cpu_bytes_to_use": 1, "sync_write_through": "yes"},
     r"\['sync_write_through'\] must be bool \| None, got 'yes'"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "s3"}]},
     r"'type' one of \['disk', 'redis'\]"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "disk", "root_dir": "/x", "max_bytes": 1,
                                                  "speed": 3}]}, r"unknown key\(s\) \['speed'\]"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "disk", "max_bytes": 1}]},
     (r"secondary_tiers\[0\]: missing key\(s\) \['root_dir'\]; accepted: "
      r"\['group_access', 'lookup_timeout_ms', 'max_bytes', 'root_dir', 'type'\]")),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "disk", "root_dir": "/x"}]},
     r"secondary_tiers\[0\]: missing key\(s\) \['max_bytes'\]"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [
        {"type": "disk", "root_dir": "/x", "max_bytes": 1},
        {"type": "disk", "root_dir": "/y", "max_bytes": -5}]},
     (r"secondary_tiers\[1\]: max_bytes must be a positive integer, got -5; accepted: "
      r"\['group_access', ")),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "disk", "root_dir": "", "max_bytes": 1}]},
     r"secondary_tiers\[0\]: root_dir must be a directory path, got ''; accepted"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": {"type": "disk"}},
     "secondary_tiers must be a list of tier dicts"),
    ({"cpu_bytes_to_use": 1, "num_cpu_blocks": 4}, r"unknown kv_connector_extra_config key"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "redis"}]},
     r"secondary_tiers\[0\]: missing key\(s\) \['url'\]; accepted: \['cluster', "),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "redis", "url": "127.0.0.1:6379"}]},
     r"url must be a redis:// or rediss:// URL, got '127.0.0.1:6379'"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "redis", "url": "redis://h",
                                                  "cluster": "yes"}]},
     r"cluster must be true or false, got 'yes'"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "redis", "url": "redis://h",
                                                  "lookup_timeout_ms": 0}]},
     r"lookup_timeout_ms must be a number > 0 and below 3.6e\+06, got 0"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "redis", "url": "redis://h",
                                                  "tls_ca_file": "/ca.pem"}]},
     r"tls_ca_file needs a rediss:// url"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "redis", "url": "redis://h"},
                                                 {"type": "redis", "url": "redis://g"}]},
     r"2 redis tiers, but at most 1 redis tier is supported"),
])
def test_bad_configs_name_the_key(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(extra)


def test_more_than_one_disk_tier_is_an_error_not_a_silent_drop() -> None:
    tiers = [{"type": "disk", "root_dir": f"/d{i}", "max_bytes": 10} for i in range(3)]
    with pytest.raises(ValueError, match=r"secondary_tiers has 3 disk tiers, but at most 1 disk "
                                         r"tier is supported"):
        parse({"cpu_bytes_to_use": 1, "secondary_tiers": tiers})


def test_tiers_are_parsed_once_into_frozen_records() -> None:
    cfg = parse({"cpu_bytes_to_use": 1, "secondary_tiers": [
        {"type": "disk", "root_dir": "/tmp/x", "max_bytes": 7}]})
    (tier,) = cfg.tiers
    assert isinstance(tier, DiskTierConfig) and cfg.disk_tier is tier
    with pytest.raises(dataclasses.FrozenInstanceError):
        tier.max_bytes = 8  # type: ignore[misc]
    # A config rebuilt from its fields (dataclasses.replace) keeps the records as they are.
    assert dataclasses.replace(cfg, store_threshold=3).tiers == (tier,)
    assert OffloadingConfig(cpu_bytes_to_use=1).disk_tier is None


def test_block_factor() -> None:
    cfg = OffloadingConfig(cpu_bytes_to_use=1)
    assert block_factor(cfg, 16) == 1  # the default: the engine's own block
    assert block_factor(OffloadingConfig(cpu_bytes_to_use=1, block_size=64), 16) == 4
    with pytest.raises(ValueError, match="block_size=40 is not a multiple of the engine's block_size=16"):
        block_factor(OffloadingConfig(cpu_bytes_to_use=1, block_size=40), 16)


def test_offload_keys_are_the_hash_of_each_last_engine_block() -> None:
    root = namespace_hash("m", "float32", 4, "layout")
    hashes: list[bytes] = []
    hash_blocks(root, list(range(1, 30)), 4, hashes)  # 7 full engine blocks
    assert offload_keys(hashes, 1) == hashes
    assert offload_keys(hashes, 3) == [hashes[2], hashes[5]]  # 2 full offload blocks
    other: list[bytes] = []
    hash_blocks(root, list(range(1, 24)) + [99] * 6, 4, other)  # differs from token 24 on
    assert offload_keys(other, 3)[0] == hashes[2] and offload_keys(other, 3)[1] != hashes[5]


def test_redis_below_disk_whatever_the_order_and_no_password_in_messages() -> None:
    url = "redis://tenant:s3cret@127.0.0.1:6379/0"
    cfg = parse({"cpu_bytes_to_use": 1, "secondary_tiers": [
        {"type": "redis", "url": url, "tenant_salt": "acme", "cluster": True},
        {"type": "disk", "root_dir": "/x", "max_bytes": 1}]})
    disk, redis = cfg.tiers
    assert disk == cfg.disk_tier and redis == cfg.redis_tier
    assert redis == RedisTierConfig(url, cluster=True, tenant_salt="acme")
    assert "s3cret" not in repr(cfg) and "acme" not in repr(cfg)
    with pytest.raises(ValueError) as err:
        parse({"cpu_bytes_to_use": 1, "secondary_tiers": [
            {"type": "redis", "url": "http://tenant:s3cret@h", "cluster": True}]})
    assert "s3cret" not in str(err.value) and "tenant:***@h" in str(err.value)


@pytest.mark.parametrize("extra, message", [
    ({"cpu_bytes_to_use": 1, "block_size": 32.0}, r"block_size\W* must be .*got 32.0"),
    ({"cpu_bytes_to_use": 1, "store_threshold": 1.5}, r"store_threshold\W* must be .*got 1.5"),
    ({"cpu_bytes_to_use": 1, "store_threshold": "2"}, r"store_threshold\W* must be .*got '2'"),
    ({"cpu_bytes_to_use": 1, "block_size": "64"}, r"block_size\W* must be .*got '64'"),
    ({"cpu_bytes_to_use": True}, r"cpu_bytes_to_use\W* must be .*got True"),
    ({"cpu_bytes_to_use": 1, "eviction_policy": 3}, r"eviction_policy\W* must be .*got 3"),
    ({"cpu_bytes_to_use": 1, "load_timeout_s": 0}, "load_timeout_s must be a number > 0"),
    ({"cpu_bytes_to_use": 1, "write_timeout_s": "30"}, r"write_timeout_s\W* must be .*got '30'"),
    ({"cpu_bytes_to_use": 1, "namespace": "a b"}, "namespace must be 1-200 letters"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "disk", "root_dir": "/x",
                                                  "max_bytes": 1.0}]},
     "max_bytes must be a positive integer, got 1.0"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "disk", "root_dir": "/x",
                                                  "max_bytes": 1, "group_access": 1}]},
     "group_access must be true or false, got 1"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "redis", "url": "redis://h",
                                                  "tenant": "team a"}]},
     "tenant must be 1-64 letters"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "redis", "url": "redis://h",
                                                  "startup_nodes": ["h:1"]}]},
     "startup_nodes needs cluster: true"),
    ({"cpu_bytes_to_use": 1, "secondary_tiers": [{"type": "redis", "url": "redis://h",
                                                  "cluster": True, "startup_nodes": ["h"]}]},
     r"startup_nodes must be a list of 'host:port' strings, got \('h',\)"),
])
def test_values_of_a_wrong_type_are_clear_errors(extra: dict[str, object], message: str) -> None:
    """Through parse_extra_config and built directly: the same check, never a TypeError later."""
    with pytest.raises(ValueError, match=message):
        parse(extra)
    with pytest.raises(ValueError, match=message):
        OffloadingConfig(**extra)  # type: ignore[arg-type]


@pytest.mark.parametrize("tiers", [
    [{"type": "Redis", "url": "redis://:s3cretPW@10.0.0.5:6379/0"}],  # a bad type
    {"type": "redis", "url": "redis://:s3cretPW@10.0.0.5:6379/0"},  # not a list
    [{"type": "redis", "url": "redis://:s3cretPW@10.0.0.5:6379/0", "cluster": "yes"}],
    [{"type": "redis", "url": "redis://u:s3cretPW@h/0", "password": "s3cretPW"}],  # unknown key
    [{"type": "s3", "secret": "s3cretPW", "token": "s3cretPW"}],
])
def test_no_config_error_shows_a_password(tiers: object) -> None:
    with pytest.raises(ValueError) as err:
        parse({"cpu_bytes_to_use": 1, "secondary_tiers": tiers})
    assert "s3cretPW" not in str(err.value)
