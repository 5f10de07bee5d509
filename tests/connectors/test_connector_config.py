"""Connector configuration and failures at the boundary: clear errors, and a connector that raises
fails only what it touches while the engine goes on serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvport import LLM, SamplingParams
from kvport.cli import main
from kvport.config import KVTransferConfig
from kvport.connectors.base import ForwardContext, KVConnectorRequestError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_unknown_connector_lists_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown KV connector 'Nope'.*ExampleConnector.*MultiConnector"):
        LLM("builtin:tiny-llama", kv_transfer_config={"kv_connector": "Nope"})


def test_bad_module_path() -> None:
    with pytest.raises(ValueError, match="cannot import KV connector module 'no_such_module'"):
        LLM("builtin:tiny-llama", kv_transfer_config={
            "kv_connector": "X", "kv_connector_module_path": "no_such_module"})
    with pytest.raises(ValueError, match="is not a KVConnectorBase subclass"):
        LLM("builtin:tiny-llama", kv_transfer_config={
            "kv_connector": "FenceConnectorTypo", "kv_connector_module_path": "connector_mock"})


def test_unknown_and_mistyped_config_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\) \['shared_path'\]; "
                                         r"accepted: \['shared_storage_path'"):
        LLM("builtin:tiny-llama", kv_transfer_config={
            "kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_path": "x"}})
    with pytest.raises(ValueError, match=r"\['shared_storage_path'\] must be str, got 3"):
        LLM("builtin:tiny-llama", kv_transfer_config={
            "kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": 3}})
    with pytest.raises(ValueError, match=r"unknown kv_transfer_config key\(s\) \['kv_conector'\]"):
        KVTransferConfig.from_any({"kv_conector": "ExampleConnector"})
    with pytest.raises(ValueError, match="kv_role must be one of"):
        KVTransferConfig.from_any({"kv_connector": "ExampleConnector", "kv_role": "both"})
    with pytest.raises(ValueError, match="not valid JSON"):
        KVTransferConfig.from_any("{kv_connector: 1}")


def test_cli_takes_a_kv_transfer_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = json.dumps({"kv_connector": "ExampleConnector",
                         "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    args = ["generate", "--prompt", "hello there, a prompt of a few blocks", "--max-tokens", "3",
            "--block-size", "4", "--kv-transfer-config", config, "--json"]
    assert main(args) == 0
    assert main(args) == 0  # a new engine: the prompt now comes from the connector's disk
    first, second = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert first["text"] == second["text"]
    assert first["num_cached_tokens"] == 0 and second["num_cached_tokens"] > 0
    assert main(["generate", "--kv-transfer-config", '{"kv_connector": "Nope"}']) == 2


@pytest.mark.parametrize("worker", ["inproc", "process"])
@pytest.mark.parametrize("hook", ["start_load_kv", "wait_for_layer_load", "save_kv_layer",
                                  "wait_for_save", "get_finished"])
def test_every_worker_hook_failure_fails_only_the_named_request(worker: str, hook: str) -> None:
    llm = LLM("builtin:tiny-llama", block_size=4, worker=worker, kv_transfer_config={
        "kv_connector": "RaisingConnector", "kv_connector_module_path": "connector_mock",
        "kv_connector_extra_config": {"hook": hook, "request_id": "bad"}})
    core = llm.engine
    good = core.add_request("good", [5] * 9, GREEDY)
    bad = core.add_request("bad", [7] * 9, GREEDY)
    while core.has_pending_work():
        core.step()
    assert bad.status.finish_reason == "error" and f"{hook}: disk on fire" in (bad.error or "")
    (ref,) = LLM("builtin:tiny-llama", block_size=4).generate([[5] * 9], GREEDY, use_tqdm=False)
    assert good.output_token_ids == ref.outputs[0].token_ids  # the other request is untouched
    core.check_no_leaks()
    llm.shutdown()


class RaisingInSave:
    """Makes the worker half's save_kv_layer raise while request `bad` is in the step."""

    def __init__(self, llm: LLM, targeted: bool) -> None:
        connector = llm.engine.runner.driver.connector  # type: ignore[union-attr]
        original = connector.save_kv_layer

        def save_kv_layer(layer_name: str, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
            if "bad" in ctx.num_scheduled_tokens:
                if targeted:
                    raise KVConnectorRequestError("disk on fire", {"bad"})
                raise OSError("disk on fire")
            original(layer_name, kv_layer, ctx)

        connector.save_kv_layer = save_kv_layer


@pytest.mark.parametrize("targeted", [True, False])
def test_a_raising_worker_hook_fails_the_affected_requests_only(tmp_path: Path, targeted: bool) -> None:
    llm = LLM("builtin:tiny-llama", block_size=4, kv_transfer_config={
        "kv_connector": "ExampleConnector", "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    reference = LLM("builtin:tiny-llama", block_size=4).generate([[5] * 9, [7] * 9], GREEDY, use_tqdm=False)
    RaisingInSave(llm, targeted)
    core = llm.engine
    good = core.add_request("good", [5] * 9, GREEDY)
    core.step()  # good's prefill runs alone
    bad = core.add_request("bad", [7] * 9, GREEDY)
    while core.has_pending_work():
        core.step()
    assert bad.status.finish_reason == "error" and "disk on fire" in (bad.error or "")
    if targeted:  # only the named request fails; good shared the step and goes on
        assert good.output_token_ids == reference[0].outputs[0].token_ids
    else:  # an untargeted failure fails the whole step it happened in
        assert good.status.finish_reason == "error"
    core.check_no_leaks()
    # The engine keeps serving.
    (out,) = llm.generate([[7] * 9], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == reference[1].outputs[0].token_ids
    core.check_no_leaks()
