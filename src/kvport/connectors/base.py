"""The KV connector API: one class, instantiated once per role, with vLLM V1's method names.

A connector moves KV blocks between the engine's paged pool and somewhere else (disk, host memory,
another engine). The same class is instantiated twice: with role SCHEDULER inside the scheduler
(decides what to load and store, keeps the bookkeeping, builds per-step metadata) and with role
WORKER next to the model runner (moves the bytes). The halves share no state: per step the
scheduler sends a `KVConnectorMetadata` to the worker, and the worker answers with a
`KVConnectorOutput`. Both are plain data that could cross a process boundary.

Scheduler side, in the order the scheduler calls them:
    set_kv_cache_spec(spec)                  once, before any request
    on_new_request(req)                      a request was added
    get_num_new_matched_tokens(req, n_local) tokens loadable beyond the local prefix hit
    update_state_after_alloc(req, ids, n)    after every successful allocation of a waiting request
    get_external_cache_hit_sources(req, n)   where the external tokens come from (optional)
    build_connector_meta(sched_out)          once at the end of every schedule(), empty steps too
    request_finished(req, block_ids)         once per finished request; True keeps its blocks
    update_connector_output(out)             the worker's answer for the step
    take_events()                            drain stored/removed events
    has_pending_work()                       keep the engine stepping while transfers run
    get_metrics()                            cumulative counters, on demand
    reset_cache(), shutdown()
    shares_storage(), storage_namespace()    whether stored KV is shared with other engines

The pool a worker gets is `(num_blocks, num_slots, 2, block_size, num_kv_heads, head_dim)`
(`KVCacheSpec`, spec.py: a slot per layer, or with several KV cache groups per layer of a group):
kvport's own pool, contiguous, or inside vLLM a strided view of vLLM's pages (kvport.vllm);
`KVCacheSpec.layout` names the bytes' order within a block.

Worker side, every step (kvport.connectors.driver has the exact order; the engine runs vLLM
0.32's order by default, the older one with kv_connector_call_order="legacy"):
    register_kv_caches(kv_cache, spec)       once, after the runner allocates the pool
    handle_preemptions(meta)                 first in every step, before anything writes KV
    bind_connector_metadata(meta)            then start_load_kv(ctx), before the forward if the
                                             step has synchronous loads (always under legacy),
                                             else after it
    wait_for_layer_load(layer) / save_kv_layer(layer, ...)   inside each attention layer
    wait_for_save()                          after the forward; every step under vllm-0.32,
                                             SKIPPED on steps with no tokens under legacy
    get_finished(finished_req_ids)           every step: completions of async sends and loads
    get_block_ids_with_load_errors()         every step
    build_connector_worker_meta()            every step
    clear_connector_metadata()               last in every step
"""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

# The pool's description, in a module of its own; named here too, where the API's users find it.
from kvport.connectors.spec import EngineInfo, KVCacheGroupSpec, KVCacheSpec
from kvport.connectors.views import RequestView, SchedulerOutputView

if TYPE_CHECKING:
    from kvport.config import KVTransferConfig

__all__ = [
    "EngineInfo", "ForwardContext", "KVCacheEvent", "KVCacheGroupSpec", "KVCacheSpec",
    "KVConnectorBase", "KVConnectorMetadata", "KVConnectorOutput", "KVConnectorRequestError",
    "KVConnectorRole", "KVConnectorWorkerMetadata", "layer_name", "plain_data",
]


class KVConnectorRequestError(Exception):
    """Raised by a worker hook to fail only the named requests (others in the step go on)."""

    def __init__(self, message: str, request_ids: set[str]) -> None:
        super().__init__(message)
        self.request_ids = set(request_ids)


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass
class KVConnectorMetadata:
    """Scheduler -> worker, one per step. Connectors subclass it as dataclasses of plain data."""


class KVConnectorWorkerMetadata(ABC):
    """Worker -> scheduler, one per step (for example ids of completed jobs)."""

    @abstractmethod
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Combine the metadata of two workers (associative and commutative)."""


@dataclass
class KVConnectorOutput:
    """The worker half's answer for one step."""

    finished_sending: set[str] = field(default_factory=set)  # requests whose async save is done
    finished_recving: set[str] = field(default_factory=set)  # requests whose async load is done
    invalid_block_ids: set[int] = field(default_factory=set)  # pool blocks a load failed to fill
    worker_meta: KVConnectorWorkerMetadata | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    # Worker hooks that raised this step: hook name -> message. The requests named by
    # KVConnectorRequestErrors fail; any other exception fails every request of the step.
    errors: dict[str, str] = field(default_factory=dict)
    error_req_ids: set[str] | None = field(default_factory=set)  # None: the whole step


@dataclass
class ForwardContext:
    """Handed to start_load_kv and save_kv_layer: the pool and this step's token placement."""

    kv_cache: torch.Tensor  # (num_blocks, num_slots, 2, block_size, num_kv_heads, head_dim)
    num_scheduled_tokens: dict[str, int]
    step: int


@dataclass(frozen=True)
class KVCacheEvent:
    """A change of what a connector holds: blocks stored (removed=False) or removed, in the
    engine's own terms, so that a router can index them without the connector's keys.

    `block_hashes` are the engine's chained hashes (RequestView.block_hashes) of consecutive
    engine blocks, in token order. A stored event also says what the blocks hold: their tokens
    (`block_size` per block), the hash of the block before the first (None: the prompt's first
    block) and, where the engine keys blocks by more than tokens, the LoRA adapter and per-block
    extra keys (cache_salt, ...). A removal names only hashes and group. `medium` is kvport's
    tier (HOST, DISK, REDIS; an engine adapter maps it to the engine's names). `group_idx`: the
    KV cache group of the blocks (0 with one group). A connector that cannot describe a block
    (an older store) sends hashes only: empty `token_ids`, `block_size` 0."""

    block_hashes: tuple[bytes, ...]
    medium: str
    removed: bool
    parent_block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    group_idx: int = 0
    lora_name: str | None = None
    lora_id: int | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None


def layer_name(layer_idx: int) -> str:
    return f"layers.{layer_idx}"


class KVConnectorBase(ABC):
    """Base of every connector. Required hooks are abstract; optional ones have neutral defaults."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole) -> None:
        self._config = config
        self._role = role
        self._connector_metadata: KVConnectorMetadata | None = None

    @classmethod
    def class_for_config(cls, config: KVTransferConfig) -> type[KVConnectorBase]:
        """The class the factory builds for `config` (this one here). A connector whose abilities
        depend on its config returns the variant that has exactly those: a MultiConnector is
        SupportsHMA only when every child is. The engine reads SupportsHMA from this class before
        any connector exists (connectors.factory.config_supports_hma)."""
        return cls

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def kv_transfer_config(self) -> KVTransferConfig:
        """The config this connector was built from (its own extra config included)."""
        return self._config

    def trace_step(self, step: int) -> None:
        """Either side: the engine announces the step that the following calls belong to: on the
        scheduler side at the start of schedule() and of update_from_output, on the worker side
        before handle_preemptions. A no-op here; the call recorder stamps its lines with it and
        a MultiConnector passes it to its children."""

    # ---- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_cache: torch.Tensor, spec: KVCacheSpec) -> None:
        """Worker, once, after the runner allocated the pool: keep a reference to it."""

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        """Worker, first in EVERY step (no-forward steps too), before metadata is bound and
        before anything writes KV. Blocks of requests preempted in this step are already free on
        the scheduler side and may be handed out again in this very step: every pending save
        that reads them must finish here."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Worker, every step, right after handle_preemptions. Overrides must call super()."""
        self._connector_metadata = metadata

    def clear_connector_metadata(self) -> None:
        """Worker, last in every step. Overrides must call super()."""
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None, "no connector metadata bound in this step"
        return self._connector_metadata

    @abstractmethod
    def start_load_kv(self, ctx: ForwardContext) -> None:
        """Worker, every step after bind: start loading KV into the pool. Before the forward on a
        step with synchronous loads (which must finish here or in wait_for_layer_load); on other
        steps after it under vLLM 0.32's order (always before it under legacy)."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, inside each attention layer before it reads KV: that layer's load is done."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        """Worker, inside each attention layer after it wrote this step's KV: start saving.
        kv_layer is the layer's view of the pool, (num_blocks, 2, block_size, heads, head_dim)."""

    def finish_forward(self) -> None:
        """Worker, under vLLM Model Runner V2's order ("vllm-mrv2") only: once per step, as soon
        as the forward no longer reads the step's KV (no-forward steps too), after the layer
        hooks and before a start_load_kv deferred past the forward, wait_for_save and
        get_finished. The other orders never call it, so nothing a connector needs may live
        only here. A no-op by default."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Worker, after the forward. Under vLLM 0.32's order every step (no-forward steps too),
        before get_finished; under legacy it is SKIPPED on steps with no scheduled tokens. A
        connector meets both orders in the field: nothing that must happen every step may live
        here (queue stores in get_finished instead)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, every step: (finished_sending, finished_recving). `finished_req_ids` are the
        requests the scheduler finished since the previous step. A send is reported once, only
        for a request whose request_finished returned True; each async load exactly once."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, every step after get_finished: pool blocks that a load failed to fill. For an
        async load, no later than the step that reports the request in finished_recving."""
        return set()

    def get_failed_load_req_ids(self) -> set[str]:
        """Worker, with get_block_ids_with_load_errors: the requests of those blocks (for an
        engine that takes load failures per request, EngineInfo.load_failures_per_request)."""
        return set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Worker, every step after get_finished: payload for the scheduler half."""
        return None

    def get_kv_connector_stats(self) -> dict[str, Any]:
        """Worker, every step: counters since the previous call."""
        return {}

    # ---- scheduler side ---------------------------------------------------------------------

    def set_kv_cache_spec(self, spec: KVCacheSpec) -> None:
        """Scheduler, once, after construction and before any request: the pool's geometry and
        hash root (the same spec the worker half gets in register_kv_caches)."""

    def on_new_request(self, request: RequestView) -> None:
        """Scheduler, when a request is added."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Scheduler, for a waiting request with no computed tokens, after the local prefix
        lookup (`num_computed_tokens` = locally cached tokens). Returns (tokens loadable beyond
        them, is_async). None: not known yet, ask again next step. is_async: the request waits
        in WAITING_FOR_REMOTE_KVS until the worker reports it in finished_recving; it must be
        False for 0 tokens. A sync load must leave at least one prompt token to compute.
        May be called several times for one request; must not change state it relies on."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: RequestView, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Scheduler, after every successful allocation of a waiting request (0 external tokens
        included), before the step's build_connector_meta. `block_ids` is the request's whole
        block table: local hits first, then the new blocks."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutputView) -> KVConnectorMetadata:
        """Scheduler, exactly once at the end of every schedule(), empty steps included. Sees
        request.num_computed_tokens before this step's advance. Must not mutate the output."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler, in update_from_output, before finished_recving/finished_sending are
        handled: consume the worker's answer."""

    def request_finished(
        self, request: RequestView, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, exactly once per request that finishes (stop, length, abort, error), before
        its blocks are freed; never for a preemption. True: the connector still reads the blocks;
        they stay allocated until the worker reports the request in finished_sending."""
        return False, None

    def take_events(self) -> list[KVCacheEvent]:
        """Scheduler, in every update_from_output: drain events since the previous call."""
        return []

    def get_metrics(self) -> Any:
        """Scheduler, on demand (LLM.get_metrics): cumulative counters, as plain data or frozen
        dataclass records (the engine turns them into plain data at its edge)."""
        return {}

    def get_external_cache_hit_sources(self, request: RequestView,
                                       num_external_tokens: int) -> dict[str, int]:
        """Scheduler, after update_state_after_alloc of a request with external tokens: how many
        of them come from each medium ("HOST", "DISK", "REDIS", ...). Empty: not known."""
        return {}

    def holds_only_what_it_was_handed(self) -> bool:
        """Scheduler: whether everything this connector can load is what this instance stored
        from what the engine computed (a private store, empty at start). Its claims can then be
        judged from a trace (kvport.trace.claim_rules). False (the default): it may load what
        others wrote (a shared store, a remote producer, a test's pretend hits)."""
        return False

    def shares_storage(self) -> bool:
        """Either side, after construction: whether what this connector stores is read by other
        engines or outlives this one (files, a shared store). An engine whose block hashes do
        not name the model (vLLM) then puts the model's identity into KVCacheSpec.hash_root."""
        return False

    def storage_namespace(self) -> str | None:
        """The name the user gave to what may share stored KV (see shares_storage), if any: it
        stands in for the model's identity where the engine cannot establish one."""
        return None

    def has_pending_work(self) -> bool:
        """Scheduler: True keeps the engine stepping with no requests (transfers in flight)."""
        return False

    def reset_cache(self) -> bool | None:
        """Scheduler: drop what the connector holds. None: not supported; False: failed."""
        return None

    def shutdown(self) -> None:
        """Either side, once at engine shutdown: finish or cancel what is in flight."""


def plain_data(value: Any) -> Any:
    """Metrics as plain data: dataclass records as dicts (fields that are None, such as a tier
    that is not configured, left out), in dicts and lists too."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(v) for f in dataclasses.fields(value)
                if (v := getattr(value, f.name)) is not None}
    if isinstance(value, dict):
        return {k: plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    return value
