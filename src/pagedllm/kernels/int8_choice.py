"""Which int8 GEMM the int8 linear layers use for many rows, chosen by measurement once per
machine.

Up to GEMV_MAX_ROWS rows a layer takes the gemv kernel of its CPU (AVX-512 VNNI or AVX2).
Above, the candidates are our AVX2 GEMMs over prepacked panels (kernels/csrc/int8_gemm.h)
and, only where the CPU has AVX-512 VNNI and PAGEDLLM_NO_VNNI is not set, torch's `_int_mm`
(a plain loop without VNNI). At load each candidate runs on the model's own shapes at
MEASURE_ROWS rows (about a second in all, beside fp32 `F.linear` for comparison); the
figures are cached in a small JSON next to the kernel build, keyed by the CPU model, the
VNNI forcing, the kernels' build and the layers' shapes (another model may prefer another
kernel), so later processes on this machine just read them.
Every candidate computes the same exact int32 sums, so the choice changes speed only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger("pagedllm")

# The GEMMs for more than GEMV_MAX_ROWS rows, by the name the compiled op takes, with the
# panel layout each needs packed at load (None: none).
AVX2_GEMMS = {"gemm avx2": "avx2", "gemm avx2_int16": "avx2_int16"}
VNNI_GEMMS = {"_int_mm": None}
MEASURE_ROWS = 64
# Candidates are in order of preference ("gemm avx2" reads half the bytes of the int16 one):
# a later one must be faster by more than this fraction to be chosen, not by noise.
MARGIN = 0.05
CACHE_FILE = "int8_choice.json"

# A timer: seconds one call of `run` takes for the candidate `name` ("fp32" for F.linear).
Timer = Callable[[str, Callable[[], object]], float]


@dataclass(frozen=True)
class Int8Choice:
    """The GEMM chosen for this machine and the figures it was chosen by (ms for the
    model's linear layers of one step at MEASURE_ROWS rows, per candidate)."""

    gemm: str
    isa: str  # "AVX-512 VNNI" or "AVX2" (the instructions the gemv and VNNI paths use)
    step_ms: dict[str, float]
    fp32_ms: float
    cached: bool = False

    def describe(self) -> str:
        figures = ", ".join(f"{k} {v:.1f}" for k, v in self.step_ms.items())
        where = "cached" if self.cached else "measured"
        return (
            f"int8 GEMM for > {_gemv_max_rows()} rows: {self.gemm} ({self.isa}; {where} at "
            f"{MEASURE_ROWS} rows on the model's shapes, ms per step: {figures}; "
            f"fp32 F.linear {self.fp32_ms:.1f})"
        )

    def slower_than_fp32(self) -> bool:
        return self.step_ms[self.gemm] > self.fp32_ms


def _gemv_max_rows() -> int:
    from pagedllm.kernels.policy import GEMV_MAX_ROWS

    return GEMV_MAX_ROWS


def isa_name(vnni: bool) -> str:
    return "AVX-512 VNNI" if vnni else "AVX2"


def candidates(vnni: bool) -> dict[str, str | None]:
    """The GEMMs worth timing: `_int_mm` only where the kernels use VNNI."""
    return {**AVX2_GEMMS, **(VNNI_GEMMS if vnni else {})}


def cpu_model_name() -> str:
    """/proc/cpuinfo's "model name" (the platform's processor name where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cache_key(
    cpu_model: str, cpu_vnni: bool, use_vnni: bool, build: str, shapes: Sequence[tuple[int, ...]]
) -> str:
    """One entry per CPU model, VNNI forced off or not, kernel build and set of shapes."""
    forced = cpu_vnni and not use_vnni
    sizes = ",".join("x".join(map(str, shape)) for shape in sorted(shapes))
    digest = hashlib.sha256(sizes.encode()).hexdigest()[:12]
    return f"{cpu_model} | vnni={'forced off' if forced else cpu_vnni} | {build} | {digest}"


def read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(path: Path, key: str, choice: Int8Choice) -> None:
    """Adds `key` to the cache file; written to a temporary file first, so a concurrent
    reader never sees half a file (the last writer wins, which is fine: same figures)."""
    data = read_cache(path)
    data[key] = {k: v for k, v in asdict(choice).items() if k != "cached"}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def wall_timer(name: str, run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(
    ops: Any,
    layers: Sequence[tuple[torch.Tensor, int]],
    gemms: dict[str, str | None],
    timer: Timer = wall_timer,
    repeats: int = 2,
    rows: int = MEASURE_ROWS,
) -> tuple[dict[str, float], float]:
    """ms of one step's linear layers (int8 weights [out, in] and how many layers have that
    shape) per GEMM, and for fp32 F.linear; each the best of `repeats`, the candidates
    alternating so that other load on the machine hits them alike."""
    gen = torch.Generator().manual_seed(0)
    totals = dict.fromkeys([*gemms, "fp32"], 0.0)
    for weight_q, count in layers:
        k = weight_q.shape[1]
        x = torch.randn(rows, k, generator=gen)
        xq = torch.randint(-127, 128, (rows, k), dtype=torch.int8, generator=gen)
        sums = weight_q.sum(dim=1, dtype=torch.int32)
        weight = weight_q.float()
        runs: dict[str, Callable[[], object]] = {"fp32": lambda w=weight, x=x: F.linear(x, w)}
        for name, panel in gemms.items():
            panels = None if panel is None else ops.int8_pack_panels(weight_q, panel)
            runs[name] = lambda p=panels, g=name, w=weight_q, s=sums, x=xq: ops.int8_matmul(
                x, w.t(), s, p, g
            )
        best = dict.fromkeys(runs, float("inf"))
        for round_ in range(repeats + 1):  # round 0 warms up and is not counted
            for name, run in runs.items():
                seconds = timer(name, run)
                if round_:
                    best[name] = min(best[name], seconds)
        for name in runs:
            totals[name] += best[name] * 1000 * count
    fp32 = totals.pop("fp32")
    return {k: round(v, 2) for k, v in totals.items()}, round(fp32, 2)


def preferred(step_ms: dict[str, float]) -> str:
    """The first candidate within MARGIN of the fastest."""
    best = min(step_ms.values())
    return next(name for name, ms in step_ms.items() if ms <= best * (1 + MARGIN))


def choose_gemm(
    ops: Any,
    layers: Sequence[tuple[torch.Tensor, int]],
    cache_path: Path,
    timer: Timer = wall_timer,
    cpu_model: str | None = None,
) -> Int8Choice:
    """The fastest GEMM for `layers` (see `measure`) on this machine: from the cache file
    when it has this machine's entry, else measured now and added to it."""
    cpu_vnni, use_vnni = ops.int8_has_vnni()
    from pagedllm.kernels.cpu import build_directory

    shapes = [(*weight_q.shape, count) for weight_q, count in layers]
    key = cache_key(
        cpu_model or cpu_model_name(), cpu_vnni, use_vnni, build_directory().name, shapes
    )
    gemms = candidates(use_vnni)
    entry = read_cache(cache_path).get(key)
    if isinstance(entry, dict) and entry.get("gemm") in gemms:
        try:
            return Int8Choice(**entry, cached=True)
        except TypeError:  # an entry of another version: measure again
            pass
    step_ms, fp32_ms = measure(ops, layers, gemms, timer)
    choice = Int8Choice(preferred(step_ms), isa_name(use_vnni), step_ms, fp32_ms)
    try:
        write_cache(cache_path, key, choice)
    except OSError as exc:  # a read-only cache: measure again next time
        logger.warning("could not cache the int8 kernel choice in %s: %s", cache_path, exc)
    return choice


def report(choice: Int8Choice) -> None:
    """One INFO line with the figures; a WARNING when int8 is slower than fp32 here."""
    logger.info("%s", choice.describe())
    if choice.slower_than_fp32():
        logger.warning(
            "int8 linear layers are slower than float32 on this CPU (%s: %.1f ms per step at "
            "%d rows vs %.1f ms for float32): without --quantization int8 it runs faster",
            choice.gemm,
            choice.step_ms[choice.gemm],
            MEASURE_ROWS,
            choice.fp32_ms,
        )
