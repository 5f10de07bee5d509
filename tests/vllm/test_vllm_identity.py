"""The model identity behind the shared tiers' namespace inside vLLM (D4), the refusal to share
a model that cannot be identified, and the load-failure policy set to recompute with a shared
tier (D5): real vLLM configs and connectors where a model directory exists, duck-typed configs
for hub ids (no network)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from harness import Harness, kv_cache_config, offload_extra, vllm_config
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.structured_output import StructuredOutputManager

from kvport.model.builtin import builtin_model_dir
from kvport.connectors.offloading.geometry import OffloadGeometry
from kvport.vllm.connector import OffloadingConnector
from kvport.vllm.identity import model_identity

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


def _namespace(model_dir: Path, disk: Path, **extra: Any) -> bytes:
    config = vllm_config({**offload_extra(disk_dir=disk), **extra}, model_dir=model_dir)
    connector = OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config(16))
    return OffloadGeometry.build(connector.inner.offloading_config, connector._spec).namespace


def _model_copy(dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copytree(builtin_model_dir("tiny-llama"), dst))


def _change_a_weight(model_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_local_dirs_of_one_name_are_told_apart_by_their_weights(tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    a = _model_copy(tmp_path / "a" / "model")
    same = _model_copy(tmp_path / "b" / "model")
    other = _model_copy(tmp_path / "c" / "model")
    _change_a_weight(other)
    assert _namespace(a, disk) == _namespace(same, disk)  # a copy elsewhere shares its KV
    assert _namespace(a, disk) != _namespace(other, disk)


def test_a_directory_with_bin_weights_is_identified_by_their_content(tmp_path: Path) -> None:
    """No safetensors (a hub-id-like directory with pytorch_model.bin): named by its content."""
    disk = tmp_path / "kv"
    dirs = []
    for name, value in (("x", 1.0), ("y", 1.0), ("z", 2.0)):
        d = _model_copy(tmp_path / name / "org" / "model")
        (d / "model.safetensors").unlink()
        torch.save({"w": torch.full((4,), value)}, d / "pytorch_model.bin")
        dirs.append(d)
    x, y, z = (_namespace(d, disk) for d in dirs)
    assert x == y and x != z


def test_a_model_without_weights_shares_no_tier_unless_a_namespace_is_named(
        tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    bare = _model_copy(tmp_path / "bare" / "model")
    (bare / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"cannot be identified.*\"namespace\""):
        _namespace(bare, disk)
    one = _namespace(bare, disk, namespace="team-a/model@v1")
    assert one == _namespace(bare, disk, namespace="team-a/model@v1")
    assert one != _namespace(bare, disk, namespace="team-a/model@v2")
    # host memory only: nothing shared, nothing to identify
    config = vllm_config(offload_extra(), model_dir=bare)
    OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config(16))


def test_a_named_namespace_also_separates_identified_models(tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    model = _model_copy(tmp_path / "m" / "model")
    assert _namespace(model, disk) != _namespace(model, disk, namespace="tenant-b")


# ---- duck-typed configs: hub ids and the fields of the identity ------------------------------

def _config(model: str = "org/m", revision: str | None = None, **over: Any) -> SimpleNamespace:
    loaded = {"hidden_size": 8, "_name_or_path": model, **over.pop("hf", {})}
    hf = SimpleNamespace(_commit_hash=over.pop("commit_hash", None), to_dict=lambda: loaded)
    mc = SimpleNamespace(model=model, revision=revision, hf_config=hf,
                         dtype=over.pop("dtype", "float32"),
                         quantization=over.pop("quantization", None),
                         model_impl=over.pop("model_impl", "auto"),
                         code_revision=over.pop("code_revision", None),
                         hf_overrides=over.pop("hf_overrides", {}))
    load = SimpleNamespace(load_format=over.pop("load_format", "auto"))
    cache = SimpleNamespace(cache_dtype=over.pop("kv_cache_dtype", "auto"),
                            calculate_kv_scales=over.pop("calculate_kv_scales", False))
    assert not over, over
    return SimpleNamespace(model_config=mc, load_config=load, cache_config=cache)


def _hub_cache(root: Path, repo: str, commit: str, weights: bytes) -> Path:
    base = root / ("models--" + repo.replace("/", "--"))
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(weights)
    return snap


def test_a_hub_id_is_pinned_by_its_cached_snapshot(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    _hub_cache(tmp_path, "org/m", COMMIT_A, b"weights-a")
    first = model_identity(_config())
    assert first.established and first.revision == COMMIT_A and first.weights_digest
    (tmp_path / "models--org--m" / "refs" / "main").write_text(COMMIT_B)  # a new commit
    _hub_cache(tmp_path, "org/m", COMMIT_B, b"weights-b")
    second = model_identity(_config())
    assert second.revision == COMMIT_B and second.key() != first.key()
    assert model_identity(_config(revision=COMMIT_A)).key() == first.key()


def test_a_hub_id_missing_from_the_cache_is_identified_only_by_a_recorded_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert not model_identity(_config()).established
    assert not model_identity(_config(revision="main")).established  # a branch moves
    recorded = model_identity(_config(commit_hash=COMMIT_A))
    assert recorded.established and recorded.revision == COMMIT_A
    assert model_identity(_config(revision=COMMIT_B)).revision == COMMIT_B
    assert recorded.key() != model_identity(_config(revision=COMMIT_B)).key()


@pytest.mark.parametrize("field,value", [
    ("dtype", "bfloat16"), ("quantization", "fp8"), ("load_format", "gguf"),
    ("model_impl", "transformers"), ("code_revision", "v2"), ("kv_cache_dtype", "fp8"),
    ("hf_overrides", {"rope_scaling": {"factor": 4.0}}), ("hf", {"num_hidden_layers": 3}),
    ("calculate_kv_scales", True),
])
def test_each_setting_that_changes_the_kv_changes_the_identity(field: str, value: Any) -> None:
    base = model_identity(_config(revision=COMMIT_A))
    changed = model_identity(_config(revision=COMMIT_A, **{field: value}))
    assert changed.key() != base.key(), field


def test_a_callable_override_is_named_the_same_in_every_process() -> None:
    def overrides(config: Any) -> Any:
        return config

    key = model_identity(_config(revision=COMMIT_A, hf_overrides=overrides)).key()
    assert "0x" not in key and "overrides" in key  # no address: another process agrees


def test_dummy_weights_are_not_an_identity(tmp_path: Path) -> None:
    model = _model_copy(tmp_path / "m")
    assert model_identity(_config(model=str(model))).established
    assert not model_identity(_config(model=str(model), load_format="dummy")).established


# ---- D5: kv_load_failure_policy ---------------------------------------------------------------

def test_a_shared_tier_sets_vllms_load_failure_policy_to_recompute(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvport.vllm.storage"):
        h = Harness.build(offload_extra(disk_dir=tmp_path), policy="fail")
    assert h.scheduler.recompute_kv_load_failures  # what vLLM's scheduler acts on
    assert h.config.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert "from 'fail' to 'recompute'" in caplog.text and "shared storage" in caplog.text
    # Its other half: the worker waits for synchronous copies rather than failing a slow one,
    # whose blocks vLLM 0.32 would keep in its prefix cache under "recompute".
    assert h.worker.worker_half.wait_sync_loads
    host_only = Harness.build(offload_extra(), policy="fail")  # no shared tier: left alone
    assert not host_only.scheduler.recompute_kv_load_failures


def test_the_recording_connector_carries_the_policy_to_vllm(tmp_path: Path) -> None:
    inner = vllm_config(offload_extra(disk_dir=tmp_path)).kv_transfer_config
    assert inner is not None
    config: VllmConfig = vllm_config({}, policy="fail")
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="RecordingConnector", kv_connector_module_path="kvport.vllm",
        kv_role="kv_both", kv_load_failure_policy="fail",
        kv_connector_extra_config={"connector": {
            "kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvport.vllm",
            "kv_connector_extra_config": inner.kv_connector_extra_config}})
    # vLLM settled its hybrid allocator for the config's first connector (SupportsHMA): the
    # recorder is not, as vLLM would have decided for it from the start
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    config.cache_config.num_gpu_blocks = 32
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_cache_config(32),
                          log_stats=False,
                          structured_output_manager=StructuredOutputManager(config),
                          block_size=16)
    assert scheduler.recompute_kv_load_failures
    scheduler.shutdown()


def test_each_tensor_parallel_rank_gets_its_share_of_the_budgets(tmp_path: Path) -> None:
    """Each rank holds a shard of every block, under its own namespace directory (accounted on
    its own): host memory and the disk's max_bytes are the engine's, split across the ranks."""
    from kvport.connectors.offloading.config import OffloadingConfig
    config = OffloadingConfig(cpu_bytes_to_use=8 << 20, secondary_tiers=[
        {"type": "disk", "root_dir": str(tmp_path), "max_bytes": 1 << 30},
        {"type": "redis", "url": "redis://127.0.0.1:1"}])
    two = config.per_rank(2)
    assert two.cpu_bytes_to_use == 4 << 20
    assert two.disk_tier is not None and two.disk_tier.max_bytes == 1 << 29
    assert two.redis_tier == config.redis_tier
    assert config.per_rank(1) == config
