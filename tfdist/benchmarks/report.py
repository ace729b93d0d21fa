"""Writing benchmark rows: CSV for scripts, a markdown table for the README."""

import csv
import os
from typing import Dict, List


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
