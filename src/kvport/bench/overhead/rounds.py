"""The rounds both engines of `kvport bench connector-overhead` are timed in.

Each round times, for each engine in turn, one batch decoding `decode_tokens` tokens and a batch
decoding 1 token; decode tokens/s = batch * (decode_tokens - 1) / (t_long - t_short): the
prefill and the per-call overhead cancel out. The engines' order rotates each round, so each
runs in every slot equally often (the slot right after another engine's run can be slower).
"""

from __future__ import annotations

from collections.abc import Callable

# (round, engine) -> (seconds of the long run, seconds of the 1-token run)
TimePair = Callable[[int, str], tuple[float, float]]


def rotated_rounds(names: list[str], rounds: int, batch: int, decode_tokens: int,
                   time_pair: TimePair, log: Callable[[str], None],
                   digits: int = 0) -> dict[str, list[float]]:
    """Decode tokens/s of each engine in each round (engine -> one rate per round)."""
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t_long, t_short = time_pair(r, name)
            rates[name].append(batch * (decode_tokens - 1) / max(t_long - t_short, 1e-9))
        log(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{n} {rates[n][-1]:.{digits}f} tok/s" for n in names))
    return rates
