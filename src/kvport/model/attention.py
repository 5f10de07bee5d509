"""Paged attention over the engine's KV pool, with PyTorch's SDPA kernels (and, on the CPU, the
native decode kernel of kvport.model.kernels). Every tensor a step builds here is made on the
pool's device.

KV pool layout (chosen once, used by the runner, attention and every connector):

    kv_cache: (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)

One engine block of one request is therefore a single contiguous run of bytes holding K and V of
every layer. Offloading moves whole blocks between tiers, so a block is one `memcpy` instead of
`2 * num_layers` small ones (the same reason vLLM's offloader prefers cross-layer blocks). Attention
reads layer `l` through the strided view `kv_cache[:, l]`; gathering a sequence's blocks from that
view copies runs of `block_size * num_kv_heads * head_dim` elements, which is as fast as gathering
from a per-layer tensor for the block sizes we use.

Batch order: the runner puts requests with one query token (decodes, or a one-token prefill chunk)
first, then the multi-token prefills. All new K/V of a layer are written into the pool before any
attention of that layer runs, so a request can read blocks that another request of the same batch
fills in this step (a prefix-cache hit on a block published at schedule time).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from kvport.model import kernels
from kvport.model.config import ModelConfig

KV_LAYOUT = "blocks-layers-kv-tokens-heads-dim"  # the name of the layout below, in hashes and specs


def kv_cache_shape(model_config: ModelConfig, num_blocks: int, block_size: int,
                   num_slots: int | None = None) -> tuple[int, ...]:
    """(num_blocks, num_slots, K/V, block_size, num_kv_heads, head_dim). A block holds one layer
    per slot: every layer with one KV cache group, a group's layers with several
    (kvport.model.kv_groups)."""
    slots = model_config.num_hidden_layers if num_slots is None else num_slots
    return (num_blocks, slots, 2, block_size, model_config.num_key_value_heads,
            model_config.head_dim)


def kv_block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype,
                   num_slots: int | None = None) -> int:
    shape = kv_cache_shape(model_config, 1, block_size, num_slots)
    n = 1
    for d in shape:
        n *= d
    return n * torch.tensor([], dtype=dtype).element_size()


class AttentionContext(Protocol):
    """What a decoder layer needs from the engine: attention for its layer index."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (T, num_heads, head_dim); k, v: (T, num_kv_heads, head_dim) after RoPE.
        Returns (T, num_heads, head_dim)."""
        ...

    def attend_rows(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Like attend, but q holds only the rows the context names (the last token of each
        request that samples, in order): K/V of every token are still stored. (N, heads, D)."""
        ...


class LayerHooks(Protocol):
    """Per-layer callbacks around attention (the KV connector's worker half plugs in here)."""

    def before_attention(self, layer_idx: int) -> None: ...

    def after_attention(self, layer_idx: int, kv_cache: torch.Tensor) -> None: ...


@dataclass
class PrefillSeq:
    """One request with several query tokens in this step."""

    query_start: int  # index of its first token in the flattened batch
    query_len: int
    context_len: int  # tokens already in the pool before this step
    # per KV cache group, (num_blocks_needed,) int64 covering context_len + query_len
    block_tables: tuple[torch.Tensor, ...]


@dataclass
class DecodeRows:
    """Sequences with one query row each, attended over their blocks: the step's decodes, or
    the last token of each request that samples (attend_rows)."""

    block_tables: torch.Tensor  # (n, max_blocks) int64, padded with block 0
    lens: torch.Tensor  # (n,) int64: keys each row sees (its position + 1)
    block_size: int
    _window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def to(self, device: torch.device) -> DecodeRows:
        """These rows with their tensors on `device` (asynchronous host-to-device copies)."""
        return DecodeRows(self.block_tables.to(device, non_blocking=True),
                          self.lens.to(device, non_blocking=True), self.block_size)

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """(n, 1, 1, max_blocks * block_size) bool: key visible. Only the torch path reads it,
        so it is built on first use, once per step."""
        n, max_blocks = self.block_tables.shape
        width = max_blocks * self.block_size
        keys = torch.arange(width, device=self.lens.device)
        return (keys.unsqueeze(0) < self.lens.unsqueeze(1)).view(n, 1, 1, width)

    def window_mask(self, window: int) -> torch.Tensor:
        """`mask` with only the last `window` keys of each row visible (a sliding layer)."""
        if window not in self._window_masks:
            n, max_blocks = self.block_tables.shape
            keys = torch.arange(max_blocks * self.block_size, device=self.lens.device).view(1, 1, 1, -1)
            self._window_masks[window] = self.mask & (keys >= (self.lens - window).view(n, 1, 1, 1))
        return self._window_masks[window]


@dataclass(frozen=True)
class LayerPlace:
    """Where a layer's K/V live and what its queries see: its KV cache group (whose block
    tables it reads), its slot in that group's blocks, and its sliding window (None: full)."""

    group: int
    slot: int
    window: int | None = None


def single_group_places(num_layers: int, windows: Sequence[int | None] = ()) -> tuple[LayerPlace, ...]:
    """One group of every layer, layer i in slot i (with the layers' windows, if any)."""
    return tuple(LayerPlace(0, i, windows[i] if i < len(windows) else None)
                 for i in range(num_layers))


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built by the runner from the scheduler output.
    Block ids and tables come per KV cache group (a tuple, in group order)."""

    slot_block_ids: tuple[torch.Tensor, ...]  # (T,) int64: block receiving each new token's K/V
    slot_offsets: torch.Tensor  # (T,) int64: offset inside that block
    num_decode_tokens: int  # the first num_decode_tokens tokens each belong to their own request
    decodes: tuple[DecodeRows, ...]
    prefills: list[PrefillSeq]
    samples: tuple[DecodeRows, ...] | None = None  # the last token of each request that samples
    # The same metadata on the CPU when this one is on another device (None: this one is on
    # the CPU): what reads block ids as Python numbers (state layers' runs) reads it there,
    # instead of one device-to-host copy per number.
    host: AttentionMetadata | None = field(default=None, repr=False)

    @property
    def on_host(self) -> AttentionMetadata:
        """This metadata as CPU tensors."""
        return self if self.host is None else self.host

    def to(self, device: torch.device) -> AttentionMetadata:
        """This (CPU) metadata with its tensors on `device`, keeping itself as `host`; itself
        for the CPU."""
        if device.type == "cpu":
            return self
        assert self.host is None, "moved already: move the host metadata"
        decodes = tuple(rows.to(device) for rows in self.decodes)
        samples = (decodes if self.samples is self.decodes  # one set of tables: move it once
                   else None if self.samples is None
                   else tuple(rows.to(device) for rows in self.samples))
        prefills = [PrefillSeq(p.query_start, p.query_len, p.context_len,
                               tuple(t.to(device, non_blocking=True) for t in p.block_tables))
                    for p in self.prefills]
        return AttentionMetadata(
            slot_block_ids=tuple(b.to(device, non_blocking=True) for b in self.slot_block_ids),
            slot_offsets=self.slot_offsets.to(device, non_blocking=True),
            num_decode_tokens=self.num_decode_tokens, decodes=decodes, prefills=prefills,
            samples=samples, host=self)


class PagedAttention:
    """`AttentionContext` over the paged pool for one step. `places[layer_idx]` says where each
    layer's K/V live and which keys its queries see (default: one group, layer i in slot i)."""

    def __init__(
        self, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
        hooks: LayerHooks | None = None, places: Sequence[LayerPlace] | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.meta = meta
        self.scale = scale
        self.hooks = hooks
        self.places = places if places is not None else single_group_places(kv_cache.shape[1])

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta, place = self.meta, self.places[layer_idx]
        layer_cache = self._store(layer_idx, k, v)
        nd = meta.num_decode_tokens
        decodes = meta.decodes[place.group]
        if nd == len(q):  # decodes only: their output is the layer's
            out = self._decode(layer_cache, q, decodes, place.window)
            self._stored(layer_idx)
            return out
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(layer_cache, q[:nd], decodes, place.window)
        for seq in meta.prefills:
            s, e = seq.query_start, seq.query_start + seq.query_len
            if seq.context_len == 0:
                # Nothing cached before this chunk: the new K/V are the whole context.
                out[s:e] = causal_attention(q[s:e], k[s:e], v[s:e], self.scale,
                                            window=place.window)
            else:
                out[s:e] = self._prefill_with_context(layer_cache, q[s:e], seq, place)
        self._stored(layer_idx)
        return out

    def attend_rows(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Each selected row is its request's last token: one query over the request's whole
        # context, which is exactly a decode over the pool.
        meta, place = self.meta, self.places[layer_idx]
        assert meta.samples is not None, "attend_rows needs the sampled rows' tables"
        layer_cache = self._store(layer_idx, k, v)
        out = self._decode(layer_cache, q, meta.samples[place.group], place.window) if len(q) else q
        self._stored(layer_idx)
        return out

    def _store(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the step's K/V of one layer into the pool; returns the layer's view of it."""
        if self.hooks is not None:
            self.hooks.before_attention(layer_idx)
        meta, place = self.meta, self.places[layer_idx]
        layer_cache = self.kv_cache[:, place.slot]  # (num_blocks, 2, block_size, kv_heads, head_dim)
        slot_blocks = meta.slot_block_ids[place.group]
        if not kernels.store_kv(layer_cache, slot_blocks, meta.slot_offsets, k, v):
            layer_cache[slot_blocks, 0, meta.slot_offsets] = k.to(layer_cache.dtype)
            layer_cache[slot_blocks, 1, meta.slot_offsets] = v.to(layer_cache.dtype)
        return layer_cache

    def _stored(self, layer_idx: int) -> None:
        if self.hooks is not None:
            self.hooks.after_attention(layer_idx, self.kv_cache)

    def _decode(self, layer_cache: torch.Tensor, q: torch.Tensor, rows: DecodeRows,
                window: int | None) -> torch.Tensor:
        """One query per request over its blocks: q (n, heads, D) -> (n, heads, D)."""
        if window is None:
            out = kernels.decode_attention(q, layer_cache, rows.block_tables, rows.lens, self.scale)
            if out is not None:  # read in place from the pool (kvport/model/paged_attention.c)
                return out
        n, max_blocks = rows.block_tables.shape
        _, _, bs, kvh, d = layer_cache.shape
        flat = rows.block_tables.view(-1)
        # index_select on the strided K (V) view: one contiguous gather, ~5x faster than
        # advanced indexing of both at once.
        k = layer_cache[:, 0].index_select(0, flat).view(n, max_blocks * bs, kvh, d).transpose(1, 2)
        v = layer_cache[:, 1].index_select(0, flat).view(n, max_blocks * bs, kvh, d).transpose(1, 2)
        # GQA without repeating K/V: the `group` query heads that share a KV head act as `group`
        # query positions of that head (same mask for all). Heads h*group..(h+1)*group-1 use
        # KV head h, as in the checkpoints.
        group = q.shape[1] // kvh
        mask = rows.mask if window is None else rows.window_mask(window)
        o = F.scaled_dot_product_attention(
            q.reshape(n, kvh, group, d), k, v, attn_mask=mask, scale=self.scale,
        )  # (n, kvh, group, D)
        return o.reshape(n, kvh * group, d)

    def _prefill_with_context(
        self, layer_cache: torch.Tensor, q: torch.Tensor, seq: PrefillSeq, place: LayerPlace,
    ) -> torch.Tensor:
        total = seq.context_len + seq.query_len
        _, _, _, kvh, d = layer_cache.shape
        table = seq.block_tables[place.group]
        # K and V gathered apart from their strided views (index_select, contiguous results
        # SDPA reads as they are), with keys visible lower-right causal: 1.69 -> 1.20 ms per
        # layer for 16 queries over 2048 cached tokens, against advanced indexing of both and
        # a materialized mask.
        k = layer_cache[:, 0].index_select(0, table).view(-1, kvh, d)[:total]
        v = layer_cache[:, 1].index_select(0, table).view(-1, kvh, d)[:total]
        if place.window is not None:
            mask: torch.Tensor | CausalBias = window_mask(seq.query_len, total, place.window,
                                                          q.device)
        elif q.device.type == "cpu":
            mask = causal_lower_right(seq.query_len, total)
        else:
            # On a GPU, torch's lower-right causal bias dispatches to the flash / efficient
            # kernels itself, and not every one of them takes GQA (fewer K/V heads than query
            # heads): an explicit mask goes through SDPA's own dispatch, which checks GQA.
            mask = window_mask(seq.query_len, total, total, q.device)
        o = F.scaled_dot_product_attention(
            _heads_first(q), _heads_first(k), _heads_first(v),
            attn_mask=mask, scale=self.scale, enable_gqa=True,
        )
        return o[0].transpose(0, 1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     query_pos: int | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of one sequence: q (L, H, D), k/v (L, KVH, D) -> (L, H, D). With
    `query_pos`, q is the single row at that position and sees keys 0..query_pos. With `window`,
    a query sees only the `window` keys up to and including its own position."""
    if query_pos is not None:
        lo = 0 if window is None else max(0, query_pos + 1 - window)
        k, v = k[lo:query_pos + 1], v[lo:query_pos + 1]
    mask = None
    if window is not None and query_pos is None:
        mask = window_mask(len(q), len(k), window, q.device)
    o = F.scaled_dot_product_attention(
        _heads_first(q), _heads_first(k), _heads_first(v),
        is_causal=query_pos is None and mask is None, attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def window_mask(num_queries: int, num_keys: int, window: int,
                device: torch.device | None = None) -> torch.Tensor:
    """(num_queries, num_keys) bool on `device` (None: the CPU), key visible: the queries are
    the last `num_queries` of the `num_keys` positions, each seeing itself and the `window - 1`
    keys before it."""
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device).unsqueeze(1)
    k_pos = torch.arange(num_keys, device=device).unsqueeze(0)
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    # (L, H, D) -> (1, H, L, D). SDPA's fast CPU kernels need 4-D inputs: with 3-D ones it falls
    # back to the O(L^2)-memory math path, about 7x slower for a 2048-token prompt.
    return x.transpose(0, 1).unsqueeze(0)


class DenseAttention:
    """`AttentionContext` without a pool: causal attention over sequences laid end to end.

    For tests and tools that run the model on whole prompts (logit checks against transformers).
    `windows[layer_idx]`: that layer's sliding window (None or absent: full attention).
    """

    def __init__(self, seq_lens: list[int], scale: float,
                 windows: Sequence[int | None] = ()) -> None:
        self.seq_lens = seq_lens
        self.scale = scale
        self.windows = windows

    def _window(self, layer_idx: int) -> int | None:
        return self.windows[layer_idx] if layer_idx < len(self.windows) else None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = []
        start = 0
        window = self._window(layer_idx)
        for n in self.seq_lens:
            end = start + n
            outs.append(causal_attention(q[start:end], k[start:end], v[start:end], self.scale,
                                         window=window))
            start = end
        return torch.cat(outs)

    def attend_rows(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rows are the last token of each sequence."""
        outs, start = [], 0
        window = self._window(layer_idx)
        for i, n in enumerate(self.seq_lens):
            outs.append(causal_attention(q[i:i + 1], k[start:start + n], v[start:start + n], self.scale,
                                         query_pos=n - 1, window=window))
            start += n
        return torch.cat(outs)
