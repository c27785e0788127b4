"""Draw a compare_vllm.py summary: one panel per metric (throughput of each workload, start-up, and TTFT/TPOT when
a summary has them), one bar per engine. matplotlib is an optional extra: pip install "pagedllm[plot]"."""

from __future__ import annotations

import math
from pathlib import Path


def plot_summary(summary: dict, path: Path, titles: dict[str, str]) -> None:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit('--plot needs matplotlib: pip install "pagedllm[plot]" (or pip install matplotlib)') from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    engines = summary["engines"]
    rows = [row for row in summary["rows"] if any(row.get(e) is not None for e in engines)]
    if not rows:
        raise SystemExit("the summary has no numbers to plot")
    ncols = min(len(rows), 4)
    nrows = math.ceil(len(rows) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.3 * ncols, 3.1 * nrows), squeeze=False)
    colors = [plt.get_cmap("tab10")(i) for i in range(len(engines))]
    labels = [titles.get(e, e) for e in engines]
    for ax, row in zip(axes.flat, rows):
        values = [row.get(e) for e in engines]
        bars = ax.bar(range(len(engines)), [v or 0 for v in values], color=colors)
        for bar, value in zip(bars, values):
            ax.annotate("n/a" if value is None else format(value, row.get("format", ".2f")),
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
        ax.set_title(row["metric"] + ("\n(lower is better)" if row.get("lower_is_better") else ""), fontsize=9)
        ax.set_xticks(range(len(engines)), labels, fontsize=8, rotation=20 if len(engines) > 2 else 0)
        ax.set_ylim(0, 1.18 * max(v or 0 for v in values) or 1)
        ax.tick_params(axis="y", labelsize=8)
    for ax in axes.flat[len(rows):]:
        ax.axis("off")
    fig.suptitle(_title(summary), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _title(summary: dict) -> str:
    parts = [summary.get("title") or summary.get("model", "")]
    rounds = summary.get("rounds", "?")
    parts.append(f"dtype {summary.get('dtype', '?')}, " + ("1 round" if rounds == 1 else f"median of {rounds} rounds"))
    if summary.get("smoke"):
        parts.append("SMOKE RUN: the numbers mean nothing")
    return "; ".join(p for p in parts if p)
