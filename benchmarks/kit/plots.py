"""Bar charts of a report (matplotlib, optional: without it there is no plot, and the caller says so)."""

from __future__ import annotations

import math
from typing import Any

from tenplex_megatron._optional import MissingExtraError, require

# one colour per system in every benchmark's plots (cold loads take their base system's)
COLORS = {"tenplex": "tab:blue", "tenplex_noverify": "lightskyblue", "mcore": "tab:orange", "central": "tab:green",
          "mcoredp": "tab:red", "adopt": "tab:purple"}


def pyplot() -> Any | None:
    """matplotlib.pyplot with the file-only Agg backend, or None (saying which extra to install) without it."""
    try:
        matplotlib = require("matplotlib", "bench", needed_by="the benchmark's plot")
    except MissingExtraError as e:
        print(f"({e}: no plot)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_log_bars(ax: Any, groups: list[str], series: dict[str, list[float]], colors: dict[str, str],
                     title: str) -> None:
    """One bar per series in each group, on a log scale, each bar labelled with its value."""
    w = 0.8 / max(len(series), 1)
    low = math.inf
    for i, (name, values) in enumerate(series.items()):
        vals = [max(v, 1e-3) for v in values]
        low = min([low, *vals])
        xs = [x + i * w for x in range(len(groups))]
        ax.bar(xs, vals, w, label=name, color=colors[name])
        for x, v in zip(xs, vals):
            ax.annotate(f"{v:.2f}" if v < 10 else f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks([x + w * (len(series) - 1) / 2 for x in range(len(groups))], groups, fontsize=8)
    ax.set_yscale("log")
    if low < math.inf:
        ax.set_ylim(bottom=low / 3)
    ax.set_title(title, fontsize=10)
    if series:
        ax.legend(fontsize=7)


def bars(ax: Any, labels: list[str], values: list[float], colors: list[str], title: str, ylabel: str,
         labelsize: int = 8) -> None:
    """One bar per label, on a linear scale."""
    ax.bar(labels, values, color=colors)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.tick_params(axis="x", labelsize=labelsize)


def save(plt: Any, fig: Any, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
