#!/usr/bin/env python3
"""Where a profiled step's GPU time goes: compute, copies, and the gaps between kernels.

Issue 45 item 15: near the balance point (a step whose compute takes about as long as its
block copies) a DLO step runs ~20% over the larger of the two, and the cause is not
established. A step can be slower for two different reasons, and this separates them:

- its kernels run slower beside the copies (the compute busy time grows against the same
  step resident), or
- the compute stream sits idle: waiting for a block's copy (idle while a copy is in flight)
  or for the host (idle with no copy in flight: launches, synchronizations).

Reads torch-profiler traces of the same step, e.g. ``bench/offload.py``'s
``resident_trace.json.gz`` and ``dlo_trace.json.gz`` (three profiled steps each, at
``--profile-res``), and prints one column per trace, per profiled step:

    python3 bench/trace_gaps.py OUT/resident_trace.json.gz OUT/dlo_trace.json.gz
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trace_events import H2D, kind_of, load_events, merged

COMPUTE_KINDS = ("gemm", "attention", "other kernels")
GAP_US = 20.0  # an idle stretch shorter than this is launch spacing, not a wait


@dataclass(frozen=True)
class StepTimes:
    """Per profiled step, in milliseconds (``gaps``: idle stretches of at least GAP_US)."""

    steps: int
    window: float
    compute: float
    by_kind: dict[str, float]
    copies: float
    copy_gb: float
    overlap: float
    idle_copying: float
    idle_host: float
    gaps: float

    def rows(self) -> list[tuple[str, str]]:
        rate = self.copy_gb / (self.copies / 1e3) if self.copies else 0.0
        return [
            ("profiled steps", f"{self.steps}"),
            ("GPU window ms", f"{self.window:.1f}"),
            ("compute busy ms", f"{self.compute:.1f}"),
            *((f"  {k} ms", f"{v:.1f}") for k, v in self.by_kind.items()),
            ("H2D copies busy ms", f"{self.copies:.1f}"),
            ("H2D GB (GB/s over copy time)", f"{self.copy_gb:.2f} ({rate:.1f})"),
            ("compute beside copies ms", f"{self.overlap:.1f}"),
            ("compute idle, a copy in flight ms", f"{self.idle_copying:.1f}"),
            ("compute idle, no copy ms", f"{self.idle_host:.1f}"),
            (f"idle stretches >= {GAP_US:.0f} us", f"{self.gaps:.0f}"),
        ]


def length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]
              ) -> list[tuple[float, float]]:
    """Intersection of two sorted, merged span lists."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def complement(spans: list[tuple[float, float]], lo: float, hi: float
               ) -> list[tuple[float, float]]:
    """The stretches of [lo, hi] that sorted, merged ``spans`` leave uncovered."""
    out, at = [], lo
    for a, b in spans:
        if a > at:
            out.append((at, min(a, hi)))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return out


def step_times(events: list[dict[str, Any]]) -> StepTimes:
    """The profiled steps' GPU time, split as the module doc says (per step)."""
    steps = sum(1 for e in events
                if e.get("name") == "bench_step" and e.get("cat") == "user_annotation")
    kinds: dict[str, list[tuple[float, float]]] = {k: [] for k in COMPUTE_KINDS}
    copies: list[tuple[float, float]] = []
    copied = 0
    gpu: list[tuple[float, float]] = []
    for e in events:
        if not e.get("dur"):
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        kind = kind_of(e)
        if kind in kinds:
            kinds[kind].append(span)
            gpu.append(span)
        elif e.get("cat") == "gpu_memcpy" and e.get("name") == H2D:
            copies.append(span)
            copied += int(e.get("args", {}).get("bytes", 0))
            gpu.append(span)
    if not gpu or not steps:
        raise ValueError("no profiled steps with GPU work in this trace")
    lo, hi = min(a for a, _ in gpu), max(b for _, b in gpu)
    compute = merged([s for spans in kinds.values() for s in spans])
    copying = merged(copies)
    idle = complement(compute, lo, hi)
    idle_copying = length(intersect(idle, copying))
    per = 1e3 * steps  # microseconds in the trace, milliseconds per step out
    return StepTimes(
        steps=steps, window=(hi - lo) / per, compute=length(compute) / per,
        by_kind={k: length(merged(v)) / per for k, v in kinds.items()},
        copies=length(copying) / per, copy_gb=copied / 1e9 / steps,
        overlap=length(intersect(compute, copying)) / per,
        idle_copying=idle_copying / per, idle_host=(length(idle) - idle_copying) / per,
        gaps=sum(1 for a, b in idle if b - a >= GAP_US) / steps,
    )


def table(names: list[str], times: list[StepTimes]) -> str:
    """One column per trace; with two or more, the last column over the first."""
    header = ["per profiled step", *names]
    if len(times) > 1:
        header.append(f"{names[-1]} / {names[0]}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    columns = [t.rows() for t in times]
    for i, (label, _) in enumerate(columns[0]):
        cells = [col[i][1] for col in columns]
        if len(times) > 1:
            first, last = (float(c.split()[0]) for c in (cells[0], cells[-1]))
            cells.append(f"{last / first:.3f}" if first else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path)
    args = p.parse_args(argv)
    names = [t.name.split(".")[0].removesuffix("_trace") for t in args.traces]
    print(table(names, [step_times(load_events(t)) for t in args.traces]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
