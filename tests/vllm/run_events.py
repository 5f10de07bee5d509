"""KV cache events through vLLM's own publisher (ZMQ on loopback) with kvport's
OffloadingConnector, read back by a subscriber as a router would: a job of the engine pool
(engine_worker.py, kind "events").

SmolLM2 with a small host tier (evictions) and a disk tier (and Redis when `redis_url` is
given): a round of prompts, another of other prompts, a reset of the prefix caches and the
connector's host tier, a third round. The job then replays every published batch from the
publisher's replay socket (the live subscription must agree with it) and answers, as ints:
each tier's contents (host slots, disk files, Redis keys) and what the events say each holds;
and, per block, the tokens and parent that vLLM's own GPU events gave it.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from run_vllm import PREFIX, QUESTIONS, connector_of, offloading_config

REPLAY_TIMEOUT_MS = 30_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    import msgspec
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvport.model.builtin import builtin_model_dir

    # With a host in the endpoint vLLM's publisher connects to it: the subscriber binds (a
    # router's side), on loopback only; "tcp://*:port" would have the engine bind every interface.
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    pub = sub.bind_to_random_port("tcp://127.0.0.1")
    replay = _free_port()
    kv_transfer = offloading_config(cfg["disk_dir"], cfg.get("redis_url"))
    kv_transfer["kv_connector_extra_config"]["cpu_bytes_to_use"] = cfg["cpu_bytes"]
    llm = LLM(model=str(builtin_model_dir("smollm2-135m")), dtype="float32", enforce_eager=True,
              max_model_len=1024, max_num_seqs=4, seed=0, kv_transfer_config=kv_transfer,
              num_gpu_blocks_override=cfg.get("num_gpu_blocks", 24),
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": f"tcp://127.0.0.1:{pub}",
                                "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                                "topic": "kv"})
    connector = connector_of(llm)
    seen: dict[bytes, list[bytes]] = {}  # every request's vLLM block hashes, as it finishes
    finished = connector.request_finished

    def noting_finished(request: Any, block_ids: Any) -> Any:
        seen[request.request_id.encode()] = list(request.block_hashes)
        return finished(request, block_ids)

    connector.request_finished = noting_finished
    finished_all = connector.request_finished_all_groups  # what vLLM calls (SupportsHMA)

    def noting_finished_all(request: Any, block_ids: Any) -> Any:
        seen[request.request_id.encode()] = list(request.block_hashes)
        return finished_all(request, block_ids)

    connector.request_finished_all_groups = noting_finished_all
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # A publisher takes a new subscription in when it next sends: what it sends before may be
    # lost to it. Warm-up requests until the subscriber gets a batch (later ones all reach it).
    for attempt in range(5):
        llm.generate([f"Warm-up {attempt}. " + PREFIX], params, use_tqdm=False)
        if sub.poll(timeout=2000, flags=zmq.POLLIN):
            break
    else:
        raise AssertionError("the subscriber got nothing")
    rounds = [[PREFIX + q for q in QUESTIONS[:3]],
              [f"Another context {i}. " * 60 + q for i, q in enumerate(QUESTIONS)]]
    for prompts in rounds:
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.reset_prefix_cache(reset_connector=True)
    llm.generate(rounds[0][:2], params, use_tqdm=False)
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + 120
    while connector.has_pending_push_work():  # write-throughs report (and are announced)
        assert time.monotonic() < deadline, "the connector's work never ended"
        core.step()
    core.scheduler.kv_event_publisher._event_queue.join()  # every batch published

    batches = _replay(ctx, replay, msgspec.msgpack.Decoder(type=KVEventBatch))
    live = _drain(sub, msgspec.msgpack.Decoder(type=KVEventBatch))
    mismatched = [seq for seq, batch in live.items() if batches.get(seq) != batch]
    half = connector.inner.scheduler_half
    every = {h for hashes in seen.values() for h in hashes}
    as_int = {h: maybe_convert_block_hash(h) for h in every}
    contents = {"CPU": sorted(as_int[k] for k in every if half.manager.lookup([k]) == 1)}
    lookup = half.lower
    if lookup.disk is not None:
        contents["disk"] = sorted(as_int[k] for k in every if lookup.disk.exists(k))
    if lookup.redis is not None:
        keys = sorted(every)
        contents["redis"] = sorted(as_int[k] for k, there in zip(keys, lookup.redis.exists(keys))
                                   if there)
    events = [_plain(e) for seq in sorted(batches) for e in batches[seq].events]
    ctx.destroy(linger=0)
    llm.llm_engine.engine_core.shutdown()
    return {"events": events, "contents": contents, "num_batches": len(batches),
            "num_live": len(live), "live_mismatched": mismatched, "pid": os.getpid()}


def _replay(ctx: Any, port: int, decoder: Any) -> dict[int, Any]:
    """Every batch the publisher still buffers, by sequence number (vLLM's replay protocol:
    ask with the first sequence number wanted, read until the end marker)."""
    import zmq

    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    batches: dict[int, Any] = {}
    while True:
        _, _, seq, payload = dealer.recv_multipart()
        if not payload:
            return batches
        batches[int.from_bytes(seq, "big")] = decoder.decode(payload)


def _drain(sub: Any, decoder: Any) -> dict[int, Any]:
    """What the live subscription received (whatever it joined in time for)."""
    import zmq

    out: dict[int, Any] = {}
    while sub.poll(timeout=1000, flags=zmq.POLLIN):
        _, seq, payload = sub.recv_multipart()
        out[int.from_bytes(seq, "big")] = decoder.decode(payload)
    return out


def _plain(event: Any) -> dict[str, Any]:
    fields = {f: getattr(event, f) for f in event.__struct_fields__}
    fields["type"] = type(event).__name__
    return fields
