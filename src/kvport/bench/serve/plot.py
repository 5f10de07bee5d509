"""The plot of `kvport bench serve`: TTFT p50, ITL p50 and total tokens/s as bars, one group
per scenario, one bar per system. Drawn from the JSON a run writes, so an earlier run's file
plots the same way (`plot_result(json.load(f), path)`)."""

from __future__ import annotations

from kvport.bench.common.command import JsonObject

PANELS = (("ttft_p50_s", "TTFT p50, s"), ("itl_p50_s", "ITL p50, s"),
          ("total_tokens_per_s", "total tokens/s"))


def plot_result(result: JsonObject, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'kvport[bench]' "
                           "(or pip install matplotlib)") from None
    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    runs = result["runs"]
    scenarios = list(dict.fromkeys(r["scenario"] for r in runs))
    systems = list(dict.fromkeys(r["system"] for r in runs))
    width = 0.8 / max(1, len(systems))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 4.2))
    for ax, (metric, label) in zip(axes, PANELS):
        for i, system in enumerate(systems):
            xs, ys = [], []
            for j, scenario in enumerate(scenarios):
                run = next((r for r in runs if r["scenario"] == scenario
                            and r["system"] == system), None)
                if run is not None and run.get(metric) is not None:
                    xs.append(j + (i - (len(systems) - 1) / 2) * width)
                    ys.append(run[metric])
            ax.bar(xs, ys, width, label=system)
        ax.set_xticks(range(len(scenarios)), scenarios, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    params = result["params"]
    fig.suptitle(f"kvport bench serve: {params['model']}, {params['request_rate']:g} req/s, "
                 f"at most {params['concurrency']} in flight", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
