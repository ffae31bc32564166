"""Draw the Grafana dashboard's panels from what a real Prometheus answered (matplotlib), so
docs can show what a user sees: one subplot per panel, one line per series, named by the
target's legend format, laid out on the dashboard's own 24-column grid."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# (panel, [(legend format, [(labels, [(unix seconds, value)])])]) per panel, in board order.
PanelData = list[tuple[dict[str, Any], list[tuple[str, list[tuple[dict[str, str], list[
    tuple[float, float]]]]]]]]


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or "value"


def draw(panels: PanelData, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(p, t) for p, t in panels if p["type"] != "row"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p, _ in shown)
    fig = plt.figure(figsize=(18, rows * 0.45))
    grid = fig.add_gridspec(rows, 24, hspace=8, wspace=2.5, top=0.965, bottom=0.02)
    start = min((t for _, targets in shown for _, series in targets for _, points in series
                 for t, _ in points), default=0.0)
    for panel, targets in shown:
        g = panel["gridPos"]
        ax = fig.add_subplot(grid[g["y"]:g["y"] + g["h"], g["x"]:g["x"] + g["w"]])
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        lines = 0
        for fmt, series in targets:
            for labels, points in series:
                if points:
                    ax.plot([t - start for t, _ in points], [v for _, v in points],
                            label=legend(fmt, labels), linewidth=1.2)
                    lines += 1
        if lines:
            ax.legend(fontsize=6, loc="best")
        else:
            ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes,
                    color="grey")
    fig.suptitle(title + " (x: seconds)", fontsize=11, y=0.99)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)
