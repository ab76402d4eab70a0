"""The seed's performance claims, each set against the measured figure that tests it.

`claims_rows(results)` takes the suite's result dicts by bench name and returns one row
per claim: what the seed says, what we measured, the acceptance target where the issue
set one, and whether it was met. Missing benches give "-" rather than an error.
"""

from __future__ import annotations

from typing import Any

Results = dict[str, dict[str, Any]]


def _row(results: Results, bench: str, system: str) -> dict[str, Any] | None:
    for r in results.get(bench, {}).get("results", []):
        if r.get("system") == system:
            return r
    return None


def _get(results: Results, bench: str, system: str, key: str) -> Any:
    row = _row(results, bench, system)
    return None if row is None else row.get(key)


def _x(a: Any, b: Any) -> float | None:
    return a / b if a is not None and b else None


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _times(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _vs(results: Results, bench: str, key: str) -> str:
    """paged's `key` over each reservation policy's that the bench ran."""
    mine = _get(results, bench, "paged", key)
    parts = []
    for policy in ("reserve-max", "reserve-pow2", "reserve-oracle"):
        other = _get(results, bench, policy, key)
        if other is not None:
            parts.append(f"{_times(_x(mine, other))} {policy}")
    return ", ".join(parts) or "-"


def _verdict(ok: bool | None, miss: str = "") -> str:
    if ok is None:
        return "-"
    return "met" if ok else f"missed{': ' + miss if miss else ''}"


def claims_rows(results: Results) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []

    def add(claim: str, seed: str, measured: str, target: str, verdict: str, bench: str) -> None:
        cmd = results.get(bench, {}).get("command", "-")
        rows.append(
            {
                "claim": claim,
                "seed": seed,
                "measured": measured,
                "target": target,
                "verdict": verdict,
                "command": f"`{cmd}`" if cmd != "-" else "-",
            }
        )

    util_p = _get(results, "throughput", "paged", "kv_utilization")
    util_m = _get(results, "throughput", "reserve-max", "kv_utilization")
    sim_p = _get(results, "memory", "paged", "kv_utilization")
    sim_m = _get(results, "memory", "reserve-max", "kv_utilization")
    add(
        "KV slots holding tokens, paged",
        "near-zero waste (< 4%)",
        f"{_pct(util_p)} (model run); {_pct(sim_p)} (bookkeeping run)",
        ">= 96%",
        _verdict(None if util_p is None else util_p >= 0.96, f"{_pct(util_p)} < 96%"),
        "throughput",
    )
    add(
        "KV slots holding tokens, reserve-max",
        "20.4-38.2% in prior systems",
        f"{_pct(util_m)} (model run); {_pct(sim_m)} (bookkeeping run)",
        "<= 40%",
        _verdict(None if util_m is None else util_m <= 0.40, f"{_pct(util_m)} > 40%"),
        "throughput",
    )
    less_m = None if _x(util_m, util_p) is None else 1 - _x(util_m, util_p)
    util_o = _get(results, "throughput", "reserve-oracle", "kv_utilization")
    less_o = None if _x(util_o, util_p) is None else 1 - _x(util_o, util_p)
    add(
        "KV memory for the same tokens",
        "55% less",
        f"{_pct(less_m)} less than reserve-max, {_pct(less_o)} less than reserve-oracle",
        ">= 55% less vs reserve-max",
        _verdict(None if less_m is None else less_m >= 0.55, _pct(less_m)),
        "throughput",
    )

    b_max = _x(
        _get(results, "throughput", "paged", "mean_running_seqs"),
        _get(results, "throughput", "reserve-max", "mean_running_seqs"),
    )
    add(
        "Batch size (mean concurrent sequences)",
        "2-3x larger",
        f"model run: {_vs(results, 'throughput', 'mean_running_seqs')}; bookkeeping run: "
        f"{_vs(results, 'memory', 'mean_running_seqs')}",
        ">= 2x reserve-max",
        _verdict(None if b_max is None else b_max >= 2, _times(b_max)),
        "throughput",
    )

    tput = {
        p: _get(results, "throughput", p, "generated_tokens_per_s")
        for p in ("paged", "reserve-max", "hf")
    }
    t_max = _x(tput["paged"], tput["reserve-max"])
    add(
        "Throughput vs contiguous reservation",
        "2-4x (vs FasterTransformer, Orca)",
        f"{_vs(results, 'throughput', 'generated_tokens_per_s')} "
        f"({tput['paged'] or '-'} vs {tput['reserve-max'] or '-'} tok/s)",
        ">= 2x reserve-max",
        _verdict(None if t_max is None else t_max >= 2, _times(t_max)),
        "throughput",
    )
    t_hf = _x(tput["paged"], tput["hf"])
    add(
        "Throughput vs Hugging Face transformers",
        "up to 24x (vLLM blog, GPU)",
        f"{_times(t_hf)} ({tput['paged'] or '-'} vs {tput['hf'] or '-'} tok/s)",
        ">= 5x",
        _verdict(None if t_hf is None else t_hf >= 5, _times(t_hf)),
        "throughput",
    )

    tpot_p = _get(results, "latency", "paged", "tpot_mean_ms")
    tpot_m = _get(results, "latency", "reserve-max", "tpot_mean_ms")
    ttft_p = _get(results, "latency", "paged", "ttft_mean_s")
    ttft_m = _get(results, "latency", "reserve-max", "ttft_mean_s")
    add(
        "Latency at the same load",
        "similar latency, higher sustainable rate",
        f"TPOT {tpot_p or '-'} vs {tpot_m or '-'} ms ({_times(_x(tpot_p, tpot_m))}); "
        f"TTFT {ttft_p or '-'} vs {ttft_m or '-'} s ({_times(_x(ttft_p, ttft_m))})",
        "-",
        "-",
        "latency",
    )

    bs = results.get("memory", {}).get("config", {}).get("block_size")
    empty = _get(results, "memory", "paged", "max_empty_slots_per_seq")
    empty_real = _get(results, "throughput", "paged", "max_empty_slots_per_seq")
    add(
        "Internal fragmentation",
        "at most one block per sequence",
        f"max {empty if empty is not None else '-'} (bookkeeping), "
        f"{empty_real if empty_real is not None else '-'} (model run) empty slots per "
        f"sequence; block size {bs or '-'}",
        "< block size",
        _verdict(None if empty is None or not bs else empty < bs),
        "memory",
    )
    kv_blocks = results.get("memory", {}).get("config", {}).get("kv_blocks")
    peak = _get(results, "memory", "paged", "peak_used_blocks")
    add(
        "External fragmentation",
        "none",
        f"every block the same size; paged filled {peak or '-'} of {kv_blocks or '-'} blocks "
        f"({_pct(_x(peak, kv_blocks))}) at its peak",
        "none by construction",
        _verdict(None if peak is None else True),
        "memory",
    )

    att = results.get("attention", {}).get("ratios", {})
    add(
        "Cost of the block-table indirection",
        "20-26% slower attention kernel than FasterTransformer's (GPU)",
        f"paged / contiguous attention: decode {_times(att.get('decode_median_overhead'))}, "
        f"prefill {_times(att.get('prefill_median_overhead'))} (median over shapes, CPU)",
        "-",
        "-",
        "attention",
    )
    sweep = results.get("block-size", {}).get("results", [])
    per = ", ".join(f"{r['block_size']}: {r['generated_tokens_per_s']}" for r in sweep)
    best = results.get("block-size", {}).get("best_block_size")
    add(
        "Block size",
        "16-64 the usual sweet spot",
        f"best {best or '-'}; tok/s by size: {per or '-'}",
        "-",
        "-",
        "block-size",
    )
    return rows
