"""Recurrent states of state-space layers, kept in the engine's paged pool.

A state-space layer (Mamba2) keeps no K/V per token: after each token it has one state (its
convolution's last inputs and its SSM state). kvport keeps it where attention keeps K/V, in the
layer's slot of a pool block (`kvport.model.kv_groups`): block j of a request holds the state after
the last token of block j computed so far. Once the block is full that is the state at the
boundary after it, which never changes again; so a prefix hit at boundary k needs block k - 1 only,
a prefix cache and a connector keep and move state blocks exactly as they do K/V blocks, and the
state a step starts from is in the block of the token before its first:

    block_size 4, 10 tokens computed, 5 scheduled          tokens 10..14 -> blocks 2, 3
    read   block 2 (state after token 9)
    write  block 2 (after token 11, its last), block 3 (after token 14)

A slot holds `2 * block_size * num_kv_heads * head_dim` values; the state takes the first
`MambaConfig.state_numel` of them (the convolution's window, then the SSM state) and must fit
(`check_state_fits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvport.model.attention import AttentionMetadata, LayerHooks, LayerPlace, PagedAttention
from kvport.model.config import ModelConfig


@dataclass(frozen=True)
class StateRun:
    """One request's tokens of this step, as a state layer sees them."""

    query_start: int  # its first token in the flattened batch
    num_tokens: int
    start: int  # tokens computed before this step (the position of its first token)
    read_block: int | None  # the block holding the state at `start`; None: start from zeros
    write_blocks: tuple[int, ...]  # the blocks of positions start .. start + num_tokens - 1


@dataclass(frozen=True)
class StepRuns:
    """A step's runs in the order state layers compute them: `batched`, decodes that start from
    no state written in this step, all at once; then `ordered`, one by one, each after the run
    that writes the block it reads (a prefix hit on blocks published when they were scheduled
    starts from a state computed in this very step)."""

    batched: list[StateRun]
    ordered: list[StateRun]


def check_state_fits(config: ModelConfig, block_size: int) -> None:
    """A ValueError naming the smallest block size whose layer slot holds a layer's state."""
    if config.mamba is None:
        return
    per_token = 2 * config.num_key_value_heads * config.head_dim
    if config.mamba.state_numel > block_size * per_token:
        need = -(-config.mamba.state_numel // per_token)
        raise ValueError(
            f"a Mamba layer's state ({config.mamba.state_numel} values) does not fit one layer "
            f"slot of a {block_size}-token block ({block_size * per_token} values); use "
            f"block_size >= {need}")


def state_runs(meta: AttentionMetadata, group: int, block_size: int) -> list[StateRun]:
    """Every request of the step, decodes first, with the blocks of its state in `group`.
    Reads the metadata's CPU copy: block ids become Python numbers here."""
    meta = meta.on_host
    runs = []
    decodes = meta.decodes[group]
    lens: list[int] = decodes.lens.tolist()
    tables: list[list[int]] = decodes.block_tables.tolist()
    for i in range(meta.num_decode_tokens):
        start = lens[i] - 1
        row = tables[i]
        read: int | None = row[(start - 1) // block_size] if start else None
        runs.append(StateRun(i, 1, start, read, (row[start // block_size],)))
    for seq in meta.prefills:
        start, end = seq.context_len, seq.context_len + seq.query_len
        table: list[int] = seq.block_tables[group].tolist()
        read = table[(start - 1) // block_size] if start else None
        writes = tuple(table[start // block_size:-(-end // block_size)])
        runs.append(StateRun(seq.query_start, seq.query_len, start, read, writes))
    return runs


def order_runs(runs: list[StateRun]) -> StepRuns:
    """`runs` as a StepRuns; `ordered` keeps their order but for the writers moved ahead (a run
    continuing its own partial block reads what it writes)."""
    writer = {b: r for r in runs for b in r.write_blocks}
    batched = [r for r in runs if r.num_tokens == 1 and writer.get(r.read_block, r) is r]
    rest = [r for r in runs if r not in batched]
    ordered: list[StateRun] = []
    placed: set[int] = set()

    def place(run: StateRun) -> None:
        if id(run) in placed:
            return
        placed.add(id(run))
        source = writer.get(run.read_block) if run.read_block is not None else None
        if source is not None and source is not run and source in rest:
            place(source)
        ordered.append(run)

    for run in rest:
        place(run)
    return StepRuns(batched, ordered)


class PagedStateAttention(PagedAttention):
    """`PagedAttention` that also hands state layers their slot of the pool and the step's runs
    (the connector's per-layer hooks run around a state layer as around attention)."""

    def __init__(
        self, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, block_size: int,
        hooks: LayerHooks | None = None, places: Sequence[LayerPlace] | None = None,
    ) -> None:
        super().__init__(kv_cache, meta, scale, hooks, places)
        self.block_size = block_size
        self._runs: dict[int, StepRuns] = {}  # group -> runs, built once per step

    def state_runs(self, layer_idx: int) -> tuple[torch.Tensor, StepRuns]:
        """(the layer's states, (num_blocks, values per slot), a view of the pool; the runs)."""
        if self.hooks is not None:
            self.hooks.before_attention(layer_idx)
        place = self.places[layer_idx]
        if place.group not in self._runs:
            self._runs[place.group] = order_runs(
                state_runs(self.meta, place.group, self.block_size))
        return self.kv_cache[:, place.slot].flatten(1), self._runs[place.group]

    def state_done(self, layer_idx: int) -> None:
        """The layer's states of this step are written."""
        self._stored(layer_idx)
