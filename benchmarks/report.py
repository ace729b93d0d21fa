"""Writing benchmark rows: CSV for scripts, a markdown table for docs/benchmarks.md, PNG plots."""

import csv
import os
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

Points = Sequence[Tuple[float, float]]
MARKERS = "osD^vP*X"
LINESTYLES = ("-", "-.", ":")  # "--" is the reference line


def write_csv(rows: List[Dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(rows: List[Dict]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(row[k]) for k in header) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_all(rows: List[Dict], out_dir: str, name: str) -> str:
    """Writes NAME.csv and NAME.md under out_dir; returns the markdown."""
    os.makedirs(out_dir, exist_ok=True)
    write_csv(rows, os.path.join(out_dir, f"{name}.csv"))
    table = markdown_table(rows)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(table)
    return table


def write_plot(path: str, lines: Mapping[str, Points], title: str, xlabel: str, ylabel: str,
               reference: Optional[Tuple[str, Points]] = None,
               xticks: Optional[Sequence[float]] = None, ymin: Optional[float] = 0.0) -> None:
    """A PNG line plot: one line per label of (x, y) points, `reference` drawn dashed.

    The y axis starts at `ymin` (0 by default: rates and speedups drawn from a cropped
    axis exaggerate differences); None lets matplotlib choose.
    """
    import matplotlib  # imported here: only plotting suites pay for it
    matplotlib.use("Agg")  # files only; servers and CI have no display
    from matplotlib import pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        if reference:
            ax.plot(*zip(*reference[1]), "k--", label=reference[0])
        # Distinct markers and dashes: lines with equal values must stay visible.
        for i, (label, points) in enumerate(lines.items()):
            ax.plot(*zip(*sorted(points)), marker=MARKERS[i % len(MARKERS)],
                    linestyle=LINESTYLES[i % len(LINESTYLES)], alpha=0.85, label=label)
        if xticks is not None:
            ax.set_xticks(list(xticks))
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        if ymin is not None:
            ax.set_ylim(bottom=ymin)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)  # pyplot keeps every open figure alive otherwise
