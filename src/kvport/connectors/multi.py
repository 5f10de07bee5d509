"""MultiConnector: several connectors run as one, in config order (index i <-> child i).

- Loads: the first child that reports matched tokens owns the load. Every child still gets
  `update_state_after_alloc` with the real blocks (the others with 0 external tokens), so a child
  that only stores knows where the KV lives. Only the owner's `finished_recving` counts.
- Stores: every child sees every request. A request kept by k children after it finished is
  reported in `finished_sending` once, after the last of the k reports. Any other completion
  report is dropped and counted.
- Metadata, worker metadata, stats, events, load errors and `kv_transfer_params` (a key given
  twice is an error) are combined per child. Every hook (finish_forward too) reaches every child
  even if one raises; the first error is raised after the last child, and completions (and
  worker metadata) gathered by a call that raised are carried into the next step, never lost.

KV cache groups: HMAMultiConnector, built when every child's config builds a SupportsHMA connector
(vLLM's rule; class_for_config), is SupportsHMA too: the engine keeps a hybrid model's groups,
every child gets the tables per group and finishes through request_finished_all_groups. With any
other child the engine keeps one group and every child gets one table, HMA or not.

NOTE: a finished request's savers ride in the metadata of the step whose `finished_req_ids` first
names it, bound before any child can report the request; an async load's owner rides in the step
that allocated the load (records: kvport.connectors.multi_metadata).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from kvport.connectors.base import (
    ForwardContext, KVCacheEvent, KVCacheSpec, KVConnectorBase, KVConnectorMetadata,
    KVConnectorOutput, KVConnectorRole,
)
from kvport.connectors.factory import config_supports_hma, create_connector, parse_extra_config
from kvport.connectors.hma import SupportsHMA, supports_hma
from kvport.connectors.multi_metadata import (
    MultiConnectorConfig, MultiConnectorMetadata, MultiConnectorWorkerMetadata,
)

from kvport.connectors.views import RequestView, SchedulerOutputView

if TYPE_CHECKING:
    import torch

    from kvport.config import KVTransferConfig
    from kvport.trace.events import TraceHeader

logger = logging.getLogger(__name__)

T = TypeVar("T")


class MultiConnector(KVConnectorBase):
    def __init__(self, config: KVTransferConfig, role: KVConnectorRole,
                 header: TraceHeader | None = None) -> None:
        """`header`: the engine's trace header, for the recorders among the children."""
        super().__init__(config, role)
        children = parse_extra_config(MultiConnectorConfig, config).child_configs()
        if supports_hma(self) and not all(config_supports_hma(c) for c in children):
            # It would hand tables per group to a child that reads one (class_for_config
            # never builds this; a subclass that declares SupportsHMA might). Checked before
            # any child exists, so none is left running.
            raise ValueError(f"{type(self).__name__} is SupportsHMA, but not every child is: "
                             f"{[c.kv_connector for c in children]}")
        self.connectors = tuple(create_connector(c, role, header) for c in children)  # config order
        self._names = tuple(f"{i}.{c.kv_connector}" for i, c in enumerate(children))
        # scheduler side
        self._matched: dict[str, tuple[int, bool]] = {}  # req_id -> (owner, is_async) of last match
        self._hit_owner: dict[str, int] = {}  # req_id -> owner of its load, for its hit sources
        self._new_async_loads: dict[str, int] = {}  # req_id -> owner, for the next metadata
        self._new_savers: dict[str, tuple[int, ...]] = {}  # req_id -> savers, for the next metadata
        # Completions still to come, so each child is told only of its own (a child told of a
        # load it never made, or of a save it never kept, sees a broken contract).
        self._pending_recv: dict[str, int] = {}  # req_id -> owner of its async load
        self._pending_send: dict[str, tuple[int, ...]] = {}  # req_id -> savers
        # worker side
        self._recv_owner: dict[str, int] = {}  # req_id -> the child whose recv report counts
        self._sends_owed: dict[str, set[int]] = {}  # req_id -> savers that have not reported yet
        self._carried: tuple[set[str], set[str]] = (set(), set())  # accepted, not yet returned
        self._carried_meta: MultiConnectorWorkerMetadata | None = None
        self._num_dropped = {"finished_recving": 0, "finished_sending": 0}  # since last stats

    @classmethod
    def class_for_config(cls, config: KVTransferConfig) -> type[KVConnectorBase]:
        """HMAMultiConnector if every child's config builds a SupportsHMA connector, else
        MultiConnector (vLLM's rule: one child that reads one block table makes the engine keep
        one KV cache group for all of them). A subclass is built as it is declared."""
        if cls not in (MultiConnector, HMAMultiConnector):
            return cls
        children = parse_extra_config(MultiConnectorConfig, config).child_configs()
        return HMAMultiConnector if all(map(config_supports_hma, children)) else MultiConnector

    def trace_step(self, step: int) -> None:
        """Forwarded to every child (a recording child stamps its lines with it)."""
        self._each("trace_step", lambda i, c: c.trace_step(step))

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        self._each("register_kv_caches", lambda i, c: c.register_kv_caches(kv_cache, spec))

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        parts = self._checked(metadata).per_connector
        self._each("handle_preemptions", lambda i, c: c.handle_preemptions(parts[i]))

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Takes over the step's load owners and savers, then binds each child its own part."""
        meta = self._checked(metadata)
        self._recv_owner.update(meta.async_load_owners)
        for rid, savers in meta.savers.items():
            assert rid not in self._sends_owed, f"{rid} finished twice"
            self._sends_owed[rid] = set(savers)
        super().bind_connector_metadata(meta)
        parts = meta.per_connector
        self._each("bind_connector_metadata", lambda i, c: c.bind_connector_metadata(parts[i]))

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._each("clear_connector_metadata", lambda i, c: c.clear_connector_metadata())

    def start_load_kv(self, ctx: ForwardContext) -> None:
        self._each("start_load_kv", lambda i, c: c.start_load_kv(ctx))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._each("wait_for_layer_load", lambda i, c: c.wait_for_layer_load(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        self._each("save_kv_layer", lambda i, c: c.save_kv_layer(layer_name, kv_layer, ctx))

    def finish_forward(self) -> None:
        self._each("finish_forward", lambda i, c: c.finish_forward())

    def wait_for_save(self) -> None:
        self._each("wait_for_save", lambda i, c: c.wait_for_save())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """A send once its last saver reported it; a recv only from its load's owner. Reports
        from any other child (stale, duplicate, not a saver or owner) are dropped and counted."""
        results, error = self._call_all("get_finished",
                                        lambda i, c: c.get_finished(finished_req_ids))
        sending, recving = self._carried
        self._carried = (set(), set())
        for i, (child_sending, child_recving) in results.items():
            for rid in child_sending or ():
                owed = self._sends_owed.get(rid)
                if owed is None or i not in owed:
                    self._drop("finished_sending", rid, i)
                    continue
                owed.discard(i)
                if not owed:
                    del self._sends_owed[rid]
                    sending.add(rid)
            for rid in child_recving or ():
                if self._recv_owner.get(rid) != i:
                    self._drop("finished_recving", rid, i)
                    continue
                del self._recv_owner[rid]
                recving.add(rid)
        if error is not None:
            self._carried = (sending, recving)  # the driver drops this call's answer
            raise error
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        results = self._each("get_block_ids_with_load_errors",
                             lambda i, c: c.get_block_ids_with_load_errors())
        return set().union(*results)

    def get_failed_load_req_ids(self) -> set[str]:
        return set().union(*self._each("get_failed_load_req_ids",
                                       lambda i, c: c.get_failed_load_req_ids()))

    def build_connector_worker_meta(self) -> MultiConnectorWorkerMetadata | None:
        """One element per child (None where a child has nothing); None if no child has any."""
        results, error = self._call_all("build_connector_worker_meta",
                                        lambda i, c: c.build_connector_worker_meta())
        per_connector = tuple(results.get(i) for i in range(len(self.connectors)))
        has_any = any(m is not None for m in per_connector)
        meta = MultiConnectorWorkerMetadata(per_connector) if has_any else None
        carried, self._carried_meta = self._carried_meta, None
        if carried is not None:  # from a step whose hook raised; aggregate merges steps too
            meta = carried if meta is None else carried.aggregate(meta)
        if error is not None:
            self._carried_meta = meta
            raise error
        return meta

    def get_kv_connector_stats(self) -> dict[str, Any]:
        """{"<i>.<connector>": child stats (non-empty ones), "MultiConnector": dropped reports}."""
        results = self._each("get_kv_connector_stats", lambda i, c: c.get_kv_connector_stats())
        stats: dict[str, Any] = {name: r for name, r in zip(self._names, results, strict=True) if r}
        dropped = {f"num_dropped_{k}": n for k, n in self._num_dropped.items() if n}
        if dropped:
            stats["MultiConnector"] = dropped
            self._num_dropped = dict.fromkeys(self._num_dropped, 0)
        return stats

    def shutdown(self) -> None:
        self._each("shutdown", lambda i, c: c.shutdown())

    # ---- scheduler side ---------------------------------------------------------------------

    def set_kv_cache_spec(self, spec: KVCacheSpec) -> None:
        self._each("set_kv_cache_spec", lambda i, c: c.set_kv_cache_spec(spec))

    def get_metrics(self) -> dict[str, Any]:
        """{"<i>.<connector>": child metrics} for the children that have any."""
        results = self._each("get_metrics", lambda i, c: c.get_metrics())
        return {name: r for name, r in zip(self._names, results, strict=True) if r}

    def on_new_request(self, request: RequestView) -> None:
        self._each("on_new_request", lambda i, c: c.on_new_request(request))

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Every child is asked. (None, False) if any child does not know yet; otherwise the
        answer of the first child with tokens > 0, which becomes the load's owner."""
        self._matched.pop(request.request_id, None)
        answers = self._each("get_num_new_matched_tokens", lambda i, c:
                             c.get_num_new_matched_tokens(request, num_computed_tokens))
        if any(n is None for n, _ in answers):
            return None, False
        for i, (n, is_async) in enumerate(answers):
            if n:
                self._matched[request.request_id] = (i, is_async)
                return n, is_async
        return 0, False

    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int] | tuple[list[int], ...],
        num_external_tokens: int,
    ) -> None:
        """Every child gets the real blocks, a copy of its own in the form the engine handed them
        (a table per group, or one); only the load's owner gets the external tokens."""
        match = self._matched.pop(request.request_id, None)
        if num_external_tokens > 0 and match is None:
            raise RuntimeError(f"MultiConnector: {request.request_id} was allocated "
                               f"{num_external_tokens} external tokens that no child matched")
        owner = match[0] if match is not None and num_external_tokens > 0 else -1
        if owner >= 0:
            self._hit_owner[request.request_id] = owner
        if match is not None and owner >= 0 and match[1]:
            self._new_async_loads[request.request_id] = owner
            self._pending_recv[request.request_id] = owner
        self._each("update_state_after_alloc", lambda i, c: c.update_state_after_alloc(
            request, _copy_tables(block_ids), num_external_tokens if i == owner else 0))

    def get_external_cache_hit_sources(self, request: RequestView,
                                       num_external_tokens: int) -> dict[str, int]:
        """The sources the load's owner names."""
        owner = self._hit_owner.pop(request.request_id, None)
        if owner is None:
            return {}
        return self.connectors[owner].get_external_cache_hit_sources(request,
                                                                     num_external_tokens)

    def shares_storage(self) -> bool:
        return any(c.shares_storage() for c in self.connectors)

    def holds_only_what_it_was_handed(self) -> bool:
        return all(c.holds_only_what_it_was_handed() for c in self.connectors)

    def storage_namespace(self) -> str | None:
        return next((n for c in self.connectors if (n := c.storage_namespace()) is not None),
                    None)

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> MultiConnectorMetadata:
        parts = self._each("build_connector_meta",
                           lambda i, c: c.build_connector_meta(scheduler_output))
        meta = MultiConnectorMetadata(tuple(parts), self._new_async_loads, self._new_savers)
        self._new_async_loads, self._new_savers = {}, {}
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Each child sees the output with its own worker metadata, stats and completions: only
        the loads it owns in finished_recving, only the saves it kept in finished_sending."""
        meta, n = connector_output.worker_meta, len(self.connectors)
        if meta is not None and not (isinstance(meta, MultiConnectorWorkerMetadata)
                                     and len(meta.per_connector) == n):
            raise TypeError(f"MultiConnector: worker metadata must be a "
                            f"MultiConnectorWorkerMetadata with {n} elements, got {meta!r}")
        recv_owner = {rid: self._pending_recv.pop(rid, -1)
                      for rid in connector_output.finished_recving}
        savers = {rid: self._pending_send.pop(rid, ())
                  for rid in connector_output.finished_sending}
        outputs = [dataclasses.replace(
            connector_output, worker_meta=None if meta is None else meta.per_connector[i],
            stats=connector_output.stats.get(name, {}),
            finished_recving={rid for rid, owner in recv_owner.items() if owner == i},
            finished_sending={rid for rid, kept in savers.items() if i in kept})
            for i, name in enumerate(self._names)]
        self._each("update_connector_output", lambda i, c: c.update_connector_output(outputs[i]))

    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Every child is told. True if any child keeps the blocks; the merged kv_transfer_params
        (a key returned by two children raises ValueError). A child that raises counts as not
        keeping them; its error is raised only if no other child keeps them, because raising
        would free blocks that another child still reads."""
        return self._finished(request, "request_finished",
                              lambda i, c: c.request_finished(request, list(block_ids)))

    def _finished(
        self, request: RequestView, hook: str,
        call: Callable[[int, KVConnectorBase], tuple[bool, dict[str, Any] | None]],
    ) -> tuple[bool, dict[str, Any] | None]:
        """request_finished or request_finished_all_groups (`call`) of every child, combined."""
        rid = request.request_id
        self._matched.pop(rid, None)
        self._hit_owner.pop(rid, None)
        answers, error = self._call_all(hook, call)
        savers = tuple(i for i, (keep, _) in answers.items() if keep)
        if savers:
            self._new_savers[rid] = self._pending_send[rid] = savers
        elif error is not None:
            raise error
        merged: dict[str, Any] = {}
        given_by: dict[str, str] = {}  # key -> child that returned it
        for i, (_, params) in answers.items():
            for key, value in (params or {}).items():
                if key in merged:
                    raise ValueError(f"MultiConnector: kv_transfer_params key {key!r} of request "
                                     f"{rid} returned by both {given_by[key]} and {self._names[i]}")
                merged[key], given_by[key] = value, self._names[i]
        return bool(savers), merged or None

    def take_events(self) -> list[KVCacheEvent]:
        """Every child's events, in child order."""
        return [e for r in self._each("take_events", lambda i, c: c.take_events()) for e in r]

    def has_pending_work(self) -> bool:
        return any(self._each("has_pending_work", lambda i, c: c.has_pending_work()))

    def reset_cache(self) -> bool | None:
        """None if no child supports it, False if any child failed, else True."""
        results = self._each("reset_cache", lambda i, c: c.reset_cache())
        if all(r is None for r in results):
            return None
        return not any(r is False for r in results)

    # ---- helpers ----------------------------------------------------------------------------

    def _call_all(self, hook: str, call: Callable[[int, KVConnectorBase], T],
                  ) -> tuple[dict[int, T], Exception | None]:
        """call(i, child) for every child in order, even after one raised. Returns the results
        of the children that did not raise (child index -> result) and the first error."""
        results: dict[int, T] = {}
        error: Exception | None = None
        for i, (name, c) in enumerate(zip(self._names, self.connectors, strict=True)):
            try:
                results[i] = call(i, c)
            except Exception as exc:  # the other children must still run their hook
                logger.exception("MultiConnector: %s of child %s failed", hook, name)
                error = error or exc
        return results, error

    def _each(self, hook: str, call: Callable[[int, KVConnectorBase], T]) -> list[T]:
        """_call_all, then the first error raised; otherwise every child's result, in order."""
        results, error = self._call_all(hook, call)
        if error is not None:
            raise error
        return list(results.values())

    def _checked(self, metadata: KVConnectorMetadata) -> MultiConnectorMetadata:
        if not (isinstance(metadata, MultiConnectorMetadata)
                and len(metadata.per_connector) == len(self.connectors)):
            raise TypeError(f"MultiConnector: expected MultiConnectorMetadata with "
                            f"{len(self.connectors)} elements, got {metadata!r}")
        return metadata

    def _drop(self, kind: str, req_id: str, child: int) -> None:
        # Late, duplicate or foreign completions are no-ops with a counter, never a double free.
        logger.warning("MultiConnector: dropped %s of %s from %s", kind, req_id, self._names[child])
        self._num_dropped[kind] += 1


class HMAMultiConnector(MultiConnector, SupportsHMA):
    """A MultiConnector whose children are all SupportsHMA, and so is it: the engine keeps a
    hybrid model's KV cache groups and every child gets the block tables per group (the step's
    view is handed on as it is). Built by the factory (MultiConnector.class_for_config)."""

    def request_finished_all_groups(
        self, request: RequestView, block_ids: tuple[list[int], ...],
    ) -> tuple[bool, dict[str, Any] | None]:
        """request_finished_all_groups of every child, combined as request_finished combines."""
        return self._finished(
            request, "request_finished_all_groups",
            lambda i, c: cast(SupportsHMA, c).request_finished_all_groups(
                request, _copy_tables(block_ids)))


def _copy_tables(block_ids: Any) -> Any:
    """A child's own copy of a block table, or of a tuple of tables (one per KV cache group):
    a child that keeps and grows a table must not grow another child's."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return tuple(list(table) for table in block_ids)
    return list(block_ids)
