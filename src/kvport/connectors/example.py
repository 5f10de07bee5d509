"""ExampleConnector: keeps each prompt's block-aligned KV on disk (a debugging reference).

Everything is synchronous. A hit is loaded, every layer, in `start_load_kv` before the forward; a
prompt is stored layer by layer in `save_kv_layer` of the step that computes the last of its aligned
tokens (with chunked prefill, the last chunk's step). The aligned prefix of an n-token prompt is its
first ((n - 1) // block_size) * block_size tokens: at least one prompt token is always computed.

An entry is a directory `<shared_storage_path>/<key>` with one safetensors file per layer (layout
and atomic writes: kvport.connectors.example_storage). key = hex of the chained block hash of the
last aligned block, which covers exactly the aligned tokens, hashed with the spec's hash_root
(model, dtype, block size, KV layout) where there is one, so two models never share an entry
even in an engine whose block hashes do not name the model (vLLM). A request is never loaded
and stored.

KV cache groups (SupportsHMA): the engine hands a block table per group. A layer stores what its
group's table holds at the aligned end (a sliding-window layer: only the window there) and loads
it into its own group's table (kvport.connectors.example_layout). The group layout is part of
the key, so an entry of one layout is never read under another; without groups keys, files and
loads are what they always were.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvport import private_dir
from kvport.connectors import example_storage as storage
from kvport.connectors.base import (
    ForwardContext, KVCacheSpec, KVConnectorBase, KVConnectorMetadata, KVConnectorRole,
)
from kvport.connectors.example_layout import EntryLayout, EntryTransfer, layer_index
from kvport.connectors.factory import parse_extra_config
from kvport.connectors.hma import SupportsHMA, group_tables

from kvport.connectors.views import RequestView, SchedulerOutputView

if TYPE_CHECKING:
    from kvport.config import KVTransferConfig

logger = logging.getLogger(__name__)


def _default_storage_path() -> str:
    # Per user, made 0o700 (__post_init__): entries hold prompts' KV, and /tmp is everyone's.
    return str(private_dir.user_temp_path() / "example")


@dataclass(frozen=True)
class ExampleConnectorConfig:
    shared_storage_path: str = field(default_factory=_default_storage_path)

    def __post_init__(self) -> None:
        if not self.shared_storage_path:
            raise ValueError("ExampleConnector: shared_storage_path must be a non-empty path, "
                             "got ''")
        if self.shared_storage_path == _default_storage_path():
            _, problem = private_dir.ensure_private_dir(self.shared_storage_path)
            if problem is not None:
                raise ValueError(f"ExampleConnector: the default shared_storage_path is not "
                                 f"private ({problem}); set shared_storage_path")


@dataclass
class ExampleConnectorMetadata(KVConnectorMetadata):
    loads: list[EntryTransfer] = field(default_factory=list)
    stores: list[EntryTransfer] = field(default_factory=list)


@dataclass
class _StorePlan:
    """Scheduler side: a store waiting for its aligned prefix to be computed."""

    key: str
    num_tokens: int
    block_size: int
    tables: tuple[list[int], ...]  # the request's block tables, grown as its chunks are scheduled


@dataclass
class _Staged:
    """Worker side: an entry being written in this step (layers land in tmp_dir)."""

    tmp_dir: str
    num_layers_written: int = 0
    failed: bool = False


def num_aligned_tokens(num_prompt_tokens: int, block_size: int) -> int:
    return max(0, (num_prompt_tokens - 1) // block_size) * block_size


def entry_key(request: RequestView, namespace: bytes = b"") -> str | None:
    """The key of the request's aligned prompt prefix; None if that has no full block."""
    bs = request.block_size
    num_blocks = num_aligned_tokens(request.num_prompt_tokens, bs) // bs
    if not num_blocks:
        return None
    block_hash = request.block_hashes[num_blocks - 1]
    return hashlib.sha256(namespace + block_hash).hexdigest() if namespace else block_hash.hex()


class ExampleConnector(KVConnectorBase, SupportsHMA):
    """Both halves take block tables in either form (hma.group_tables): a tuple per KV cache
    group from an engine that keeps groups for it, one flat table from any other caller."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.example_config = parse_extra_config(ExampleConnectorConfig, config)
        self.root = self.example_config.shared_storage_path
        self._do_load = config.kv_role in ("kv_both", "kv_consumer")
        self._do_store = config.kv_role in ("kv_both", "kv_producer")
        self._namespace = b""  # the spec's hash_root and group layout (set_kv_cache_spec)
        # Both halves: the KV cache groups (set_kv_cache_spec, register_kv_caches); none until
        # then, as for every caller that does not name groups.
        self._layout = EntryLayout()
        self._num_layers: int | None = None  # the model's layers (register_kv_caches)
        # scheduler side
        self._pending_loads: dict[str, EntryTransfer] = {}  # req_id -> load of this step
        self._store_plans: dict[str, _StorePlan] = {}  # req_id -> store waiting for its prefix
        self._keys_planned: dict[str, str] = {}  # key -> the one req_id planning to store it
        self._admitted_this_step: set[str] = set()
        # worker side
        self._staged: dict[str, _Staged] = {}  # req_id -> entry being written in this step
        self._load_errors: set[int] = set()
        self._stats: dict[str, int] = {}  # counter -> value since the last get_kv_connector_stats

    def shares_storage(self) -> bool:
        """Entries are files that other engines read and that outlive this one."""
        return True

    # ---- scheduler side ---------------------------------------------------------------------

    def set_kv_cache_spec(self, spec: KVCacheSpec) -> None:
        """Keys are namespaced by the hash root and the group layout (EntryLayout.key_tag)."""
        self._layout = EntryLayout.of(spec)
        self._namespace = spec.hash_root + self._layout.key_tag()

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """A complete entry for the aligned prompt prefix: (aligned - local hit tokens, False)."""
        key = entry_key(request, self._namespace)
        num_aligned = num_aligned_tokens(request.num_prompt_tokens, request.block_size)
        if not self._do_load or key is None or num_aligned <= num_computed_tokens:
            return 0, False
        manifest = storage.read_manifest(self.root, key)
        if manifest is None or manifest.get("num_tokens") != num_aligned:
            return 0, False
        return num_aligned - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int] | tuple[list[int], ...],
        num_external_tokens: int,
    ) -> None:
        """External tokens > 0 plan a load into the blocks after the local hits (a sliding group:
        only those inside its window at the aligned end). Otherwise a store is planned if no
        entry exists yet and no other live request plans the same one."""
        rid, bs = request.request_id, request.block_size
        tables = group_tables(block_ids)
        key = entry_key(request, self._namespace)
        self._drop_store_plan(rid)
        self._admitted_this_step.add(rid)
        if key is None:
            return
        num_aligned = num_aligned_tokens(request.num_prompt_tokens, bs)
        if num_external_tokens > 0:
            start = num_aligned - num_external_tokens
            assert start >= 0 and start % bs == 0, (
                f"{rid}: {num_external_tokens} external tokens do not end at the aligned prefix "
                f"({num_aligned} tokens, block size {bs})")
            self._pending_loads[rid] = EntryTransfer(
                rid, key, num_aligned, self._layout.spans(tables, num_aligned, start, bs))
        elif (self._do_store and key not in self._keys_planned
              and storage.read_manifest(self.root, key) is None):
            self._store_plans[rid] = _StorePlan(key, num_aligned, bs, tables)
            self._keys_planned[key] = rid

    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> ExampleConnectorMetadata:
        """This step's loads, and the stores whose aligned prefix is computed by its end: a store
        goes out in the step where num_computed_tokens + num_scheduled_tokens reaches the aligned
        count, so save_kv_layer runs after the KV of every aligned token was written."""
        so = scheduler_output
        meta = ExampleConnectorMetadata()
        for rid in set(so.preempted_req_ids) - self._admitted_this_step:
            self._drop_store_plan(rid)  # its blocks are gone; its re-admission plans again
        num_computed: dict[str, int] = {}  # req_id -> tokens computed before this step
        for new in so.scheduled_new_reqs:  # admitted, or running and resent in full
            num_computed[new.req_id] = new.num_computed_tokens
            if new.req_id in self._pending_loads:
                meta.loads.append(self._pending_loads.pop(new.req_id))
            if new.req_id in self._store_plans:  # its whole tables (a resent request's are new)
                self._store_plans[new.req_id].tables = group_tables(new.block_ids)
        for cached in so.scheduled_cached_reqs:
            num_computed[cached.req_id] = cached.num_computed_tokens
            growing = self._store_plans.get(cached.req_id)
            if growing is not None:  # its new blocks, group by group
                for table, added in zip(growing.tables, group_tables(cached.new_block_ids),
                                        strict=True):
                    table.extend(added)
        for rid, computed in num_computed.items():
            plan = self._store_plans.get(rid)
            if plan is None or computed + so.num_scheduled_tokens.get(rid, 0) < plan.num_tokens:
                continue
            # NOTE: a sliding group's copy keeps ids the engine freed as the window moved on;
            # the span reads only the window at the aligned end, which this step still holds.
            meta.stores.append(EntryTransfer(rid, plan.key, plan.num_tokens, self._layout.spans(
                plan.tables, plan.num_tokens, 0, plan.block_size)))
            self._drop_store_plan(rid)
        if self._pending_loads:  # allocated but not scheduled: impossible for sync loads
            logger.warning("ExampleConnector: dropping loads of unscheduled requests %s",
                           sorted(self._pending_loads))
            self._pending_loads.clear()
        self._admitted_this_step.clear()
        return meta

    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Always (False, None): stores finish within their step, nothing reads the blocks later."""
        self._drop_store_plan(request.request_id)
        self._pending_loads.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(
        self, request: RequestView, block_ids: tuple[list[int], ...],
    ) -> tuple[bool, dict[str, Any] | None]:
        """`request_finished` with a table per KV cache group: the same answer, for every group."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def reset_cache(self) -> bool | None:
        """None (not supported): the directory may be shared with other engines."""
        return None

    def _drop_store_plan(self, req_id: str) -> None:
        plan = self._store_plans.pop(req_id, None)
        if plan is not None and self._keys_planned.get(plan.key) == req_id:
            del self._keys_planned[plan.key]

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        """Keeps the group layout and the model's layer count (a pool block holds one group's
        layers, so the pool's second dimension counts slots, not layers)."""
        self._layout = EntryLayout.of(spec)
        self._num_layers = spec.num_layers

    def start_load_kv(self, ctx: ForwardContext) -> None:
        """Loads this step's hits, every layer into its group's blocks, before the forward. A load
        that fails (entry gone, torn, other shape) writes nothing and reports its blocks as load
        errors (recomputed)."""
        for load in self._meta().loads:
            try:
                writes = self._read_load(load, ctx.kv_cache)
            except Exception:  # any unreadable entry is a miss, never wrong KV
                logger.warning("ExampleConnector: loading entry %s for request %s failed",
                               load.key, load.req_id, exc_info=True)
                self._load_errors.update(load.block_ids)
                self._count("num_load_errors")
                continue
            for slot, block_ids, data in writes:
                storage.scatter(ctx.kv_cache[:, slot], block_ids, data)
            self._count("num_loaded_tokens", load.num_tokens - load.start_token)

    def _read_load(self, load: EntryTransfer, kv_cache: torch.Tensor,
                   ) -> list[tuple[int, tuple[int, ...], torch.Tensor]]:
        """Per layer (slot, blocks, tokens to write there), all read and checked before anything
        is written. Raises if the entry cannot supply a span exactly."""
        bs = kv_cache.shape[3]
        layer_tokens = self._layout.layer_tokens(self._model_layers(kv_cache), load.num_tokens, bs)
        layers = storage.read_entry(self.root, load.key, layer_tokens, kv_cache)
        writes = []
        for i, data in enumerate(layers):
            group, slot = self._layout.place(i)
            span = load.spans[group]
            # The file holds the layer's last layer_tokens[i] tokens; the span starts inside them.
            skip = span.start_token - (load.num_tokens - layer_tokens[i])
            if skip < 0 or len(data) - skip != len(span.block_ids) * bs:
                raise ValueError(f"layer {i} holds tokens from {load.num_tokens - len(data)}, "
                                 f"the load needs {len(span.block_ids)} blocks from "
                                 f"{span.start_token}")
            writes.append((slot, span.block_ids, data[skip:]))
        return writes

    def wait_for_layer_load(self, layer_name: str) -> None:
        """No-op: start_load_kv loaded every layer already."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        """Writes this layer of each store into the entry's hidden directory and renames it into
        place after the last layer. A failed write drops the store (a later miss), not the step.
        A layer writes the tokens its group's span holds (a sliding-window layer: its window)."""
        num_layers = self._model_layers(ctx.kv_cache)
        # Without groups every layer follows the one table (and any name will do, as before).
        group = self._layout.place(layer_index(layer_name))[0] if self._layout.groups else 0
        for store in self._meta().stores:
            staged = self._staged.setdefault(
                store.req_id, _Staged(storage.new_tmp_dir(self.root, store.key)))
            if staged.failed or staged.num_layers_written == num_layers:
                continue
            if not self._load_errors.isdisjoint(store.block_ids):
                # NOTE: a block whose load failed this step holds garbage, and so does every
                # token computed from it: never publish that (the request recomputes it).
                staged.failed = True
                self._count("num_store_errors")
                continue
            try:
                # (num_tokens, 2, num_kv_heads, head_dim)
                data = storage.gather(kv_layer, store.spans[group].block_ids)
                storage.write_layer(staged.tmp_dir, layer_name, data)
                staged.num_layers_written += 1
                if staged.num_layers_written == num_layers:
                    storage.publish(self.root, store.key, staged.tmp_dir, store.num_tokens,
                                    num_layers, ctx.kv_cache)
                    self._count("num_stored_tokens", store.num_tokens)
            except Exception:  # a full disk must not fail the step: the entry just misses
                logger.warning("ExampleConnector: storing entry %s for request %s failed",
                               store.key, store.req_id, exc_info=True)
                shutil.rmtree(staged.tmp_dir, ignore_errors=True)
                staged.failed = True
                self._count("num_store_errors")

    def wait_for_save(self) -> None:
        """No-op: save_kv_layer publishes each entry with its last layer."""

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> dict[str, Any]:
        """Non-zero counters since the previous call: num_loaded_tokens, num_stored_tokens,
        num_load_errors, num_store_errors."""
        stats, self._stats = self._stats, {}
        return stats

    def clear_connector_metadata(self) -> None:
        """Also discards entries whose forward stopped before their last layer."""
        self._discard_staged()
        super().clear_connector_metadata()

    def shutdown(self) -> None:
        self._discard_staged()

    def _discard_staged(self) -> None:
        for rid, staged in self._staged.items():
            if not staged.failed and os.path.isdir(staged.tmp_dir):
                logger.warning("ExampleConnector: store of request %s stopped after %d layers; "
                               "discarded", rid, staged.num_layers_written)
                shutil.rmtree(staged.tmp_dir, ignore_errors=True)
        self._staged.clear()

    def _model_layers(self, kv_cache: torch.Tensor) -> int:
        # A worker never given the spec (driven by hand) sees a pool of one group: slot = layer.
        return self._num_layers if self._num_layers is not None else kv_cache.shape[1]

    def _meta(self) -> ExampleConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ExampleConnectorMetadata), f"not ExampleConnector's: {meta!r}"
        return meta

    def _count(self, name: str, n: int = 1) -> None:
        self._stats[name] = self._stats.get(name, 0) + n

