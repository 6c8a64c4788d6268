#!/usr/bin/env python3
"""A DLO step as a two-stream pipeline: how long it takes with N device slots.

Issue 45 item 15. The copy stream loads block k into the slot block k - N used, so it waits
for that block's compute to end; the compute stream runs block k once its copy landed. Flux's
double blocks copy longer than they compute and its single blocks the other way round near
the balance point, so with two slots the copies cannot run ahead through the singles and bank
time for the next step's doubles: the step is about sum(max(compute, next copy)) instead of
max(sum compute, sum copy). This replays that rule over a few steps (the ring wraps: the last
blocks prefetch the next step's first) and prints the steady-state step per slot count.

Blocks are given as ``COUNTxCOMPUTE/COPY`` in milliseconds, in execution order, e.g. the
profile of a 1536^2 b1 Flux step on an H100 (``bench/offload.py --profile-res 1536``, read
with ``bench/trace_gaps.py``):

    python3 bench/slot_model.py --blocks 19x7.4/12.8 38x7.1/5.35 --slots 2 3 4 6 8 12
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

BLOCKS = re.compile(r"(\d+)x([\d.]+)/([\d.]+)")


def parse_blocks(specs: Sequence[str]) -> list[tuple[float, float]]:
    """``COUNTxCOMPUTE/COPY`` groups -> one (compute ms, copy ms) per block, in order."""
    out: list[tuple[float, float]] = []
    for spec in specs:
        m = BLOCKS.fullmatch(spec)
        if m is None:
            raise argparse.ArgumentTypeError(f"not COUNTxCOMPUTE/COPY: {spec!r}")
        out += [(float(m[2]), float(m[3]))] * int(m[1])
    return out


def step_ms(blocks: Sequence[tuple[float, float]], slots: int, *, steps: int = 8) -> float:
    """The last of ``steps`` back-to-back steps, once the ring is in its steady state."""
    if slots < 2:
        raise ValueError("DLO needs at least two slots")
    run = list(blocks) * steps
    copied = [0.0] * len(run)  # when block i's bytes landed
    computed = [0.0] * len(run)  # when block i's compute ended
    for i, (compute, copy) in enumerate(run):
        slot_free = computed[i - slots] if i >= slots else 0.0
        copy_start = max(copied[i - 1] if i else 0.0, slot_free)
        copied[i] = copy_start + copy
        computed[i] = max(computed[i - 1] if i else 0.0, copied[i]) + compute
    return computed[-1] - computed[-1 - len(blocks)]


def table(blocks: Sequence[tuple[float, float]], slot_counts: Sequence[int]) -> str:
    compute = sum(c for c, _ in blocks)
    copy = sum(t for _, t in blocks)
    floor = max(compute, copy)
    lines = [f"{len(blocks)} blocks: compute {compute:.1f} ms, copies {copy:.1f} ms, "
             f"floor max(compute, copies) {floor:.1f} ms", "",
             "| slots | step ms | / floor |", "|---|---|---|"]
    for slots in slot_counts:
        ms = step_ms(blocks, slots)
        lines.append(f"| {slots} | {ms:.1f} | {ms / floor:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", nargs="+", required=True,
                   help="COUNTxCOMPUTE/COPY groups in execution order (milliseconds)")
    p.add_argument("--slots", nargs="+", type=int, default=[2, 3, 4, 6, 8])
    args = p.parse_args(argv)
    print(table(parse_blocks(args.blocks), args.slots))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
