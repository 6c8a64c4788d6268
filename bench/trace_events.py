"""Torch-profiler trace events as the trace readers see them (shared by bench/trace_*.py).

What kind of GPU work an event is, the union of time spans, and loading a chrome trace
(gzipped or not) as ``prof.export_chrome_trace`` writes it.
"""

from __future__ import annotations

import bisect
import gzip
import json
from pathlib import Path
from typing import Any

H2D = "Memcpy HtoD (Pinned -> Device)"
KINDS = ("nccl", "gemm", "attention", "other kernels", "memset")


def kind_of(event: dict[str, Any]) -> str | None:
    """Which kind of GPU work an event is (None: not GPU work that can overlap a copy)."""
    cat, name = event.get("cat"), event.get("name", "")
    if cat == "gpu_memset":
        return "memset"
    if cat != "kernel":
        return None
    if name.startswith("nccl"):
        return "nccl"
    if "sdpa" in name or "flash" in name or "fmha" in name or "attention" in name:
        return "attention"
    if "nvjet" in name or "gemm" in name or "cutlass" in name or "xmma" in name:
        return "gemm"
    return "other kernels"


def covered(spans: list[tuple[float, float]], starts: list[float], a: float, b: float) -> float:
    """Length of [a, b] covered by the union of sorted, merged ``spans``."""
    total = 0.0
    i = max(bisect.bisect_right(starts, a) - 1, 0)
    while i < len(spans) and spans[i][0] < b:
        lo, hi = max(spans[i][0], a), min(spans[i][1], b)
        total += max(0.0, hi - lo)
        i += 1
    return total


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def load_events(path: Path) -> list[dict[str, Any]]:
    """The ``traceEvents`` of a chrome trace file (``.gz`` or plain JSON)."""
    with gzip.open(path) if path.suffix == ".gz" else open(path, "rb") as f:
        return json.load(f)["traceEvents"]
