"""The plot of a workload benchmark: TTFT per round (multi-turn: median over users) or per query
in run order (long-doc), one line per configuration. It draws from the JSON a run writes, so a
file of an earlier run plots the same way (`plot_result(json.load(f), path)`)."""

from __future__ import annotations

import math
import statistics

from kvport.bench.common.command import JsonObject


def plot_result(result: JsonObject, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'kvport[bench]' "
                           "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    multi = result["workload"] == "multi-turn"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = result["configs"] + ([dict(result["ideal"], name="ideal")] if result["ideal"] else [])
    for c in series:
        by_x: dict[int, list[float]] = {}
        for r in c["per_request"]:
            by_x.setdefault(r["index"] + 1 if multi else r["phase"] + 1, []).append(r["ttft_s"])
        xs = sorted(by_x)
        ys = [statistics.median(by_x[x]) for x in xs]
        ax.plot(xs, ys, marker="o", label=c["name"], linestyle="--" if c["name"] == "ideal" else "-")
    ax.set_xlabel("round" if multi else "query (run order; documents round-robin)")
    ax.set_ylabel("TTFT, s" + (" (median over users)" if multi else ""))
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    # plain numbers on the log axis (0.2, 0.5, 1, 2, 5), not 2x10^-1
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(_two_five))
    ax.set_title(f"kvport bench {result['workload']}: {result['model']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _two_five(value: float, _pos: int) -> str:
    """Label the 2x and 5x minor ticks of a log axis."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if round(mantissa, 6) in (2.0, 5.0) else ""
