"""The one output writer, and the one stats helper.

`write_outputs` prints a bench's result as a table and writes `<bench>.json`, `<bench>.md`
and `<bench>_<plot>.png` into its `--out` folder. `distribution` gives mean, median and
p99 with one percentile definition: linear interpolation between closest ranks (numpy's).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Plot:
    """A chart of series (x values, y values) by label, as "line", "bar" or "stack"."""

    name: str
    title: str
    xlabel: str
    ylabel: str
    series: dict[str, tuple[Sequence[Any], Sequence[Any]]] = field(default_factory=dict)
    kind: str = "line"
    log2_x: bool = False
    ylim: tuple[float, float] | None = None


def distribution(
    values: Sequence[float], unit: str, prefix: str = "", digits: int = 4
) -> dict[str, float | None]:
    """`{prefix}mean{unit}`, `{prefix}median{unit}` and `{prefix}p99{unit}` (None if empty)."""
    arr = np.asarray(values, dtype=float)
    # np.median is the 50th percentile, interpolated the same way.
    stats = {"mean": np.mean, "median": np.median, "p99": lambda a: np.percentile(a, 99)}
    return {
        f"{prefix}{name}{unit}": round(float(f(arr)), digits) if arr.size else None
        for name, f in stats.items()
    }


def call_seconds(fn: Callable[[], Any], repeats: int) -> tuple[list[float], Any]:
    """The wall time of each of `repeats` calls after a warm-up one, and the last result."""
    out, times = fn(), []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out


def median_seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """The median wall time of `repeats` calls after a warm-up one, and the last result."""
    times, out = call_seconds(fn, repeats)
    return float(np.median(times)), out


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """The sorted values, and the fraction of values at or below each."""
    return sorted(values), [(i + 1) / len(values) for i in range(len(values))]


def fmt(value: Any) -> str:
    """A figure as a table shows it: about three significant digits, "-" for none."""
    if not isinstance(value, float) or not math.isfinite(value):
        return "-" if value is None else str(value)
    digits = 0 if abs(value) >= 100 else 1 if abs(value) >= 10 else 2
    return f"{value:.3g}" if abs(value) < 0.01 else f"{value:.{digits}f}"


def markdown_table(rows: Sequence[dict[str, Any]], columns: str) -> str:
    cols = [c.split("=", 1) for c in columns.split("|")]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k, _ in cols) + " |" for r in rows]
    return "\n".join(lines)


def ratio(a: float | None, b: float | None, digits: int = 2) -> float | None:
    return None if a is None or not b else round(a / b, digits)


def add_ratios(result: dict[str, Any], key: str, baselines: Sequence[str]) -> None:
    """Each row's `<key>_vs_<baseline>` (rows named by "system"), also in "ratios"."""
    rows = {r["system"]: r for r in result["results"]}
    for base, r in ((b, r) for b in baselines if b in rows for r in rows.values()):
        r[f"{key}_vs_{base}"] = ratio(r.get(key), rows[base].get(key))
        result["ratios"].setdefault(r["system"], {})[f"{key}_vs_{base}"] = r[f"{key}_vs_{base}"]


def markdown_body(result: dict[str, Any]) -> list[str]:
    """Command, workload, config, table and notes: a bench's page, and its report section."""
    lines = [f"`{result.get('command', '')}`", ""]
    for title in ("summary", "workload", "config"):
        if result.get(title):
            items = ", ".join(f"{k} {fmt(v)}" for k, v in result[title].items())
            lines += [f"{title.capitalize()}: {items}", ""]
    return [*lines, result.get("table_md", ""), "", *[f"* {n}" for n in result["notes"]]]


def write_outputs(
    result: dict[str, Any], out_dir: str, columns: str, plots: Sequence[Plot] = ()
) -> dict[str, Any]:
    """Print the table; write JSON, Markdown and each plot under out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    name = result["bench"]
    files = {kind: os.path.join(out_dir, f"{name}.{kind}") for kind in ("json", "md")}
    for plot in plots:
        path = os.path.join(out_dir, f"{name}_{plot.name}.png")
        if not _save_plot(path, plot):
            result["notes"].append("plots skipped: matplotlib is not installed")
            break
        files[f"png_{plot.name}"] = path
    result["files"] = files
    result["table_md"] = markdown_table(result["results"], columns)
    env = ", ".join(f"{k} {v}" for k, v in result["environment"].items())
    images = [os.path.basename(p) for k, p in files.items() if k.startswith("png_")]
    page = [f"# pagedllm bench {name}", "", *markdown_body(result), "", f"Environment: {env}"]
    page += ["", *[f"![{p}]({p})" for p in images]]
    with open(files["md"], "w", encoding="utf-8") as f:
        f.write("\n".join(page) + "\n")
    with open(files["json"], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, default=str)
    print(f"\n{name}: {result['command']}")
    for key, value in result.get("summary", {}).items():
        print(f"  {key + ':':<32}{fmt(value)}")
    print(result["table_md"])
    for note in result["notes"]:
        print(f"  note: {note}")
    print(f"  wrote {', '.join(files.values())}")
    return result


def _save_plot(path: str, plot: Plot) -> bool:
    try:
        import matplotlib
    except ImportError:  # an optional dependency: pip install 'pagedllm[bench]'
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bottom: Any = 0.0
    for label, (x, y) in plot.series.items():
        ys = np.array([math.nan if v is None else v for v in y], dtype=float)
        if plot.kind == "line":
            ax.plot(x, ys, marker="o" if len(ys) <= 40 else None, label=label)
        else:
            ax.bar([str(v) for v in x], ys, bottom=bottom, label=label)
            bottom = bottom + np.nan_to_num(ys) if plot.kind == "stack" else 0.0
    ax.set(title=plot.title, xlabel=plot.xlabel, ylabel=plot.ylabel, ylim=plot.ylim)
    if plot.log2_x:
        ax.set_xscale("log", base=2)
    if plot.kind != "line" and max(len(x) for x, _ in plot.series.values()) > 8:
        ax.tick_params(axis="x", labelrotation=70, labelsize=7)  # long bar labels
    if len(plot.series) > 1:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
