#!/usr/bin/env python3
"""Per-copy H2D rates in a profiler trace, against what ran beside each copy.

Issue 4's AllGather step is the copy floor of the rate its host->device copies reach, and in
some enables a busy rank's copies run 3-7% below the rate the same pages reach alone. This
reads torch-profiler traces (``bench/offload_dp.py`` keeps one per rank and variant,
``allgather_<variant>_trace_rank<r>.json.gz``) and, for every pinned H2D memcpy, takes its
rate as the GPU timed it (CUPTI: the copy engine's own start and end, so a copy held back in a
queue is not counted as slow) and the share of its time during which NCCL kernels, GEMMs,
attention, other compute kernels and memsets ran on the same GPU. The table groups copies by
how much NCCL and compute overlapped them, which separates "the DMA itself is slower next to
X" from "the copies wait".

    python3 bench/trace_copies.py OUT/dp/allgather_s8_trace_rank0.json.gz [more traces]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from trace_events import H2D, KINDS, covered, kind_of, load_events, merged


def copies_of(path: Path) -> list[dict[str, Any]]:
    """Every pinned H2D copy of a trace with its GB/s and per-kind overlap fractions."""
    events = load_events(path)
    spans: dict[str, list[tuple[float, float]]] = {k: [] for k in KINDS}
    spans["compute"] = []
    for e in events:
        kind = kind_of(e)
        if kind is not None and e.get("dur"):
            interval = (e["ts"], e["ts"] + e["dur"])
            spans[kind].append(interval)
            if kind in ("gemm", "attention", "other kernels"):
                spans["compute"].append(interval)
    union = {k: merged(v) for k, v in spans.items()}
    starts = {k: [a for a, _ in v] for k, v in union.items()}
    out = []
    for e in sorted((e for e in events if e.get("cat") == "gpu_memcpy" and e["name"] == H2D),
                    key=lambda e: e["ts"]):
        a, b = e["ts"], e["ts"] + e["dur"]
        nbytes = int(e["args"]["bytes"])
        row = {"bytes": nbytes, "us": e["dur"], "gbps": nbytes / e["dur"] / 1e3}
        for k in union:
            row[k] = covered(union[k], starts[k], a, b) / e["dur"] if e["dur"] else 0.0
        out.append(row)
    return out


def band(x: float) -> str:
    """Overlap share in words: none (< 5%), some (< 50%), most."""
    return "none" if x < 0.05 else "some" if x < 0.5 else "most"


def summary(path: Path) -> str:
    rows = copies_of(path)
    if not rows:
        return f"{path.name}: no pinned H2D copies"
    total_bytes = sum(r["bytes"] for r in rows)
    total_us = sum(r["us"] for r in rows)
    lines = [f"{path.name}: {len(rows)} copies, {total_bytes / 1e9:.2f} GB, "
             f"{total_bytes / total_us / 1e3:.1f} GB/s over their copy time; mean overlap "
             + ", ".join(f"{k} {statistics.fmean(r[k] for r in rows):.2f}" for k in (*KINDS, "compute")),
             "", "| NCCL overlap | compute overlap | copies | GB | GB/s (bytes / copy time) | slowest copy GB/s |",
             "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((band(r["nccl"]), band(r["compute"])), []).append(r)
    order = ("none", "some", "most")
    for key in sorted(groups, key=lambda k: (order.index(k[0]), order.index(k[1]))):
        g = groups[key]
        nbytes, us = sum(r["bytes"] for r in g), sum(r["us"] for r in g)
        lines.append(f"| {key[0]} | {key[1]} | {len(g)} | {nbytes / 1e9:.2f} | "
                     f"{nbytes / us / 1e3:.1f} | {min(r['gbps'] for r in g):.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path)
    args = p.parse_args(argv)
    for path in args.traces:
        print(summary(path), end="\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
