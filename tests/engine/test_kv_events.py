"""The KV connector's cache events reach the user through LLM.take_kv_events(), bounded."""

from __future__ import annotations

from kvport import LLM, KVTransferConfig, SamplingParams
from kvport.connectors.base import KVCacheEvent, KVConnectorRole
from kvport.connectors.noop import NoOpConnector
from kvport.engine.kv_transfer import KVTransferTracker

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def offloading_llm() -> LLM:
    return LLM("builtin:tiny-llama", block_size=4, num_kv_blocks=32, max_model_len=64,
               kv_transfer_config={"kv_connector": "OffloadingConnector",
                                   "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20,
                                                                 "block_size": 4}})


def drain(llm: LLM) -> None:
    while llm.engine.has_pending_work():  # stores report after the requests finished
        llm.engine.step()


def test_stored_blocks_are_reported_once_then_drained() -> None:
    llm = offloading_llm()
    prompt = list(range(3, 20))  # 17 tokens: 4 full blocks
    llm.generate([prompt], GREEDY, use_tqdm=False)
    drain(llm)
    events = llm.take_kv_events()
    stored = [h for e in events if not e.removed for h in e.block_hashes]
    assert {e.medium for e in events} == {"HOST"}
    assert len(stored) == 4 and len(set(stored)) == 4
    assert llm.take_kv_events() == []  # drained
    assert llm.get_metrics()["kv_transfer"]["num_events"] == len(events)
    llm.engine.check_no_leaks()


class EventfulConnector(NoOpConnector):
    """Reports three stored blocks at every take_events."""

    def take_events(self) -> list[KVCacheEvent]:
        return [KVCacheEvent((bytes([i]),), "host", removed=False) for i in range(3)]


def test_events_nobody_takes_are_bounded_and_counted() -> None:
    connector = EventfulConnector(KVTransferConfig("NoOpConnector"), KVConnectorRole.SCHEDULER)
    tracker = KVTransferTracker(connector, block_size=4, max_events=5)
    for _ in range(4):
        tracker.after_step(None)
    assert len(tracker.take_events()) == 5  # the newest five
    assert tracker.stats.num_events == 12 and tracker.stats.num_dropped_events == 7
    assert tracker.take_events() == []
