"""Writing a bench's results: a printed table, `<name>.json`, `<name>.md` and PNG plots.

Every bench returns one result dict: {"bench", "command", "config", "environment",
"workload", "results": [rows], "ratios", "notes", "files"}; this module turns it into
files under `--out` and lists what it wrote in `files`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

Columns = Sequence[tuple[str, str]]  # (key in a row, column header)


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) < 0.01 else f"{value:.2f}"
    return str(value)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Columns) -> str:
    head = "| " + " | ".join(h for _, h in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 2)


def add_ratios(rows: list[dict[str, Any]], key: str, baselines: Sequence[str]) -> dict[str, Any]:
    """Each row's `key` divided by each baseline row's (rows are named by 'system')."""
    by_name = {r["system"]: r for r in rows}
    out: dict[str, Any] = {}
    for base in baselines:
        if base not in by_name:
            continue
        for r in rows:
            value = ratio(r.get(key), by_name[base].get(key))
            r[f"{key}_vs_{base}"] = value
            out.setdefault(r["system"], {})[f"{key}_vs_{base}"] = value
    return out


def write_outputs(
    result: dict[str, Any],
    out_dir: str,
    columns: Columns,
    plots: Sequence[tuple[str, Callable[[Any], None]]] = (),
) -> dict[str, Any]:
    """Print the table; write JSON, Markdown and each plot (`draw(axes)`) under out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    name = result["bench"]
    table = markdown_table(result["results"], columns)
    files = {
        "json": os.path.join(out_dir, f"{name}.json"),
        "md": os.path.join(out_dir, f"{name}.md"),
    }
    for plot_name, draw in plots:
        path = os.path.join(out_dir, f"{name}_{plot_name}.png")
        _save_plot(path, draw)
        files[f"png_{plot_name}"] = path
    result["files"] = files
    result["table_md"] = table
    with open(files["md"], "w", encoding="utf-8") as f:
        f.write(markdown_report(result))
    with open(files["json"], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"\n{name}: {result.get('command', '')}\n{table}")
    for note in result.get("notes", []):
        print(f"  note: {note}")
    print(f"  wrote {', '.join(files.values())}")
    return result


def markdown_report(result: dict[str, Any]) -> str:
    lines = [f"# pagedllm bench {result['bench']}", "", f"`{result.get('command', '')}`", ""]
    wl = result.get("workload")
    if wl:
        lines += ["Workload: " + ", ".join(f"{k} {v}" for k, v in wl.items()), ""]
    cfg = result.get("config")
    if cfg:
        lines += ["Config: " + ", ".join(f"{k} {v}" for k, v in cfg.items()), ""]
    lines += [result["table_md"], ""]
    lines += [f"* {note}" for note in result.get("notes", [])]
    env = result.get("environment")
    if env:
        lines += ["", "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items())]
    images = [p for k, p in result.get("files", {}).items() if k.startswith("png_")]
    lines += ["", *[f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in images]]
    return "\n".join(lines) + "\n"


def _save_plot(path: str, draw: Callable[[Any], None]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        draw(ax)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
