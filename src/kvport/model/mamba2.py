"""The Mamba2 mixer (state-space duality) over flattened tokens, its states in the paged pool.

Per token t of a request, with x, B, C from a causal depthwise convolution of the projected input
and dt = clamp(softplus(dt_raw + dt_bias)), per head h (A_h = -exp(A_log_h) < 0):

    state_t = exp(dt_t A_h) state_{t-1} + dt_t x_t B_t^T        (d_head, d_state)
    y_t     = state_t C_t + D_h x_t

then y is normed with a SiLU gate and projected out (transformers' `GraniteMoeHybridMambaLayer`).
A prefill runs in chunks of one block (`_scan`): within a chunk the outputs are a masked,
decay-weighted attention-like product (quadratic in the block size), across chunks the state is
carried; the state after each chunk is the state at a block boundary, which is what the pool keeps
(kvport.model.state_cache). Chunks are aligned to the request's blocks by padding with dt = 0
tokens, which neither decay nor add to the state. A decode step is the recurrence above, batched.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from kvport.model.config import MambaConfig
from kvport.model.state_cache import StateRun, StepRuns


@runtime_checkable
class StateContext(Protocol):
    """What a state layer needs from the engine (kvport.model.state_cache.PagedStateAttention)."""

    block_size: int

    def state_runs(self, layer_idx: int) -> tuple[torch.Tensor, StepRuns]: ...

    def state_done(self, layer_idx: int) -> None: ...


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(gate) over the whole width, in float32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(gate.float())
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(self.weight.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: MambaConfig, hidden_size: int, eps: float, layer_idx: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        inner, conv_dim, heads = cfg.intermediate_size, cfg.conv_dim, cfg.n_heads
        self.in_proj = skip_init(nn.Linear, hidden_size, inner + conv_dim + heads,
                                 bias=cfg.proj_bias, dtype=dtype)
        self.conv1d = skip_init(nn.Conv1d, conv_dim, conv_dim, cfg.d_conv, groups=conv_dim,
                                bias=cfg.conv_bias, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.zeros(heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(heads, dtype=dtype))
        self.D = nn.Parameter(torch.zeros(heads, dtype=dtype))
        self.norm = GatedRMSNorm(inner, eps, dtype)
        self.out_proj = skip_init(nn.Linear, inner, hidden_size, bias=cfg.proj_bias, dtype=dtype)
        self.conv_numel = (cfg.d_conv - 1) * conv_dim

    def forward(self, x: torch.Tensor, ctx: StateContext) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); reads and writes the layer's states in the pool."""
        cfg = self.cfg
        gate, xbc, dt = self.in_proj(x).split(
            [cfg.intermediate_size, cfg.conv_dim, cfg.n_heads], dim=-1)
        dt = torch.clamp(F.softplus(dt.float() + self.dt_bias.float()), cfg.dt_min, cfg.dt_max)
        pool, runs = ctx.state_runs(self.layer_idx)
        y = torch.empty(x.shape[0], cfg.intermediate_size, dtype=torch.float32, device=x.device)
        if runs.batched:
            self._decode(pool, runs.batched, xbc, dt, y)
        for run in runs.ordered:
            if run.num_tokens == 1:
                self._decode(pool, [run], xbc, dt, y)
            else:
                self._prefill(pool, run, xbc, dt, y, ctx.block_size)
        ctx.state_done(self.layer_idx)
        return self.out_proj(self.norm(y, gate).to(x.dtype))

    # --- states in the pool ---------------------------------------------------------------------

    def _read(self, pool: torch.Tensor,
              blocks: list[int | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv windows (n, d_conv - 1, conv_dim), ssm states (n, heads, d_head, d_state)) in
        float32; zeros for a request that starts at token 0 (block None)."""
        cfg = self.cfg
        # Every tensor on the pool's device: the block ids are host data (the step's runs),
        # copied over once per call.
        dev = pool.device
        conv = torch.zeros(len(blocks), cfg.d_conv - 1, cfg.conv_dim, device=dev)
        ssm = torch.zeros(len(blocks), cfg.n_heads, cfg.d_head, cfg.d_state, device=dev)
        held = [i for i, b in enumerate(blocks) if b is not None]
        if held:
            rows = pool[torch.tensor([blocks[i] for i in held], device=dev)].float()
            conv[held] = rows[:, :self.conv_numel].view(len(held), cfg.d_conv - 1, cfg.conv_dim)
            ssm[held] = rows[:, self.conv_numel:cfg.state_numel].view(
                len(held), cfg.n_heads, cfg.d_head, cfg.d_state)
        return conv, ssm

    def _write(self, pool: torch.Tensor, blocks: list[int], conv: torch.Tensor,
               ssm: torch.Tensor) -> None:
        rows = torch.cat([conv.flatten(1), ssm.flatten(1)], dim=1).to(pool.dtype)
        pool[torch.tensor(blocks, device=pool.device), :self.cfg.state_numel] = rows

    # --- decode: one token per request, batched -------------------------------------------------

    def _decode(self, pool: torch.Tensor, runs: list[StateRun], xbc: torch.Tensor,
                dt: torch.Tensor, y: torch.Tensor) -> None:
        rows = torch.tensor([r.query_start for r in runs], device=xbc.device)
        conv, ssm = self._read(pool, [r.read_block for r in runs])
        window = torch.cat([conv, xbc[rows].float().unsqueeze(1)], dim=1)  # (n, d_conv, conv_dim)
        xs, b, c = self._split(F.silu(self._conv(window.transpose(1, 2))))  # (n, H, P|N|N)
        step = dt[rows]  # (n, H)
        decay = torch.exp(step * self._a())  # (n, H)
        ssm = ssm * decay[..., None, None] + (xs * step[..., None]).unsqueeze(-1) * b.unsqueeze(2)
        y[rows] = (torch.einsum("nhpk,nhk->nhp", ssm, c) + self.D.float()[:, None] * xs).flatten(1)
        self._write(pool, [r.write_blocks[0] for r in runs], window[:, 1:], ssm)

    # --- prefill: one request, chunked at its block boundaries ----------------------------------

    def _prefill(self, pool: torch.Tensor, run: StateRun, xbc: torch.Tensor, dt: torch.Tensor,
                 y: torch.Tensor, block_size: int) -> None:
        cfg = self.cfg
        s, n, k = run.query_start, run.num_tokens, cfg.d_conv - 1
        conv, ssm = self._read(pool, [run.read_block])
        seq = torch.cat([conv[0], xbc[s:s + n].float()])  # (k + n, conv_dim)
        xs, b, c = self._split(F.silu(self._conv(seq.unfold(0, cfg.d_conv, 1))))
        pad = run.start % block_size  # dt = 0 tokens before the first, so chunks are blocks
        ends = [min(n, (i + 1) * block_size - pad) for i in range(len(run.write_blocks))]
        ys, states = _scan(xs, dt[s:s + n], b, c, self._a(), ssm[0], pad, block_size)
        y[s:s + n] = (ys + self.D.float()[:, None] * xs).flatten(1)
        conv_states = torch.stack([seq[e:e + k] for e in ends])  # inputs before each chunk end
        self._write(pool, list(run.write_blocks), conv_states, states)

    def _conv(self, windows: torch.Tensor) -> torch.Tensor:
        """The causal depthwise convolution over windows (n, conv_dim, d_conv), each ending at
        its token -> (n, conv_dim). A weighted sum: torch's conv1d costs 90 us per call at 16
        rows on this CPU (oneDNN setup), the sum a few."""
        out = (windows * self.conv1d.weight.float().squeeze(1)).sum(-1)
        return out if self.conv1d.bias is None else out + self.conv1d.bias.float()

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, conv_dim) -> x (T, H, P), B and C (T, H, N), each group's B and C for its heads."""
        cfg = self.cfg
        xs, b, c = xbc.split([cfg.intermediate_size, cfg.n_groups * cfg.d_state,
                              cfg.n_groups * cfg.d_state], dim=-1)
        per_group = cfg.n_heads // cfg.n_groups
        b = b.reshape(-1, cfg.n_groups, cfg.d_state).repeat_interleave(per_group, dim=1)
        c = c.reshape(-1, cfg.n_groups, cfg.d_state).repeat_interleave(per_group, dim=1)
        return xs.reshape(-1, cfg.n_heads, cfg.d_head), b, c

    def _a(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())


def _scan(xs: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, a: torch.Tensor,
          state: torch.Tensor, pad: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM over n tokens from `state`, in chunks of `chunk` tokens, the first `pad` of which
    are padding. xs (n, H, P), dt (n, H), b and c (n, H, N), a (H,), state (H, P, N) ->
    (y without the D term (n, H, P), the state after each chunk (num_chunks, H, P, N))."""
    n = xs.shape[0]
    total = -(-(pad + n) // chunk) * chunk
    back = total - pad - n

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (pad, back))
        return t.view(total // chunk, chunk, *t.shape[1:])

    xdt = chunks(xs * dt[..., None])  # (c, L, H, P)
    b, c = chunks(b), chunks(c)  # (c, L, H, N)
    cum = torch.cumsum(chunks(dt * a), dim=1)  # (c, L, H): log decay from the chunk start
    # Within a chunk: query l sees key s <= l, weighted by the decay between them.
    diff = cum.unsqueeze(2) - cum.unsqueeze(1)  # (c, L, S, H)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=xs.device).tril().view(1, chunk, chunk, 1)
    decays = torch.exp(diff.masked_fill(~causal, -torch.inf))
    weights = torch.einsum("clhn,cshn->clsh", c, b) * decays
    y = torch.einsum("clsh,cshp->clhp", weights, xdt)
    # What each chunk adds to the state, decayed to its end; then carried across chunks.
    to_end = torch.exp(cum[:, -1:] - cum)  # (c, L, H)
    added = torch.einsum("clhn,clh,clhp->chpn", b, to_end, xdt)
    chunk_decay = torch.exp(cum[:, -1])  # (c, H)
    starts, ends = [], []
    for i in range(cum.shape[0]):
        starts.append(state)
        state = state * chunk_decay[i][:, None, None] + added[i]
        ends.append(state)
    start_states = torch.stack(starts)  # (c, H, P, N)
    y = y + torch.einsum("clhn,chpn->clhp", c, start_states) * torch.exp(cum)[..., None]
    return y.reshape(total, *y.shape[2:])[pad:pad + n], torch.stack(ends)
