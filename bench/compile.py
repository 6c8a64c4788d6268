#!/usr/bin/env python3
"""Regional torch.compile of the DiT blocks (`--compile`): eager vs compiled ms per step.

One process, a random Flux-structured transformer (the Flux family's DiT,
default widths with guidance embeds, bf16; ``--layers`` / ``--single-layers`` cut the block
count to fit short device sessions: per-block times scale to full Flux, 19 + 38 blocks),
1024x1024 latents, the given batch sizes. Both variants run the same model object: first
eager, then after ``compile_repeated_blocks`` (the engine's own function). Optionally with
every block streamed by DLO (``--dlo``), where a compute-bound batch shows whether compiling
moves the floor. ms/step = median of CUDA-event timings of back-to-back steps; the compiled
variant's warm-up steps include its compilation (reported separately).

    python3 bench/compile.py --layers 4 --single-layers 8 --batches 1 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import harness
import torch

from ditserve.engine.config import OffloadConfig
from ditserve.engine.offload import enable_offload
from ditserve.engine.runner.compiled_blocks import compile_repeated_blocks


def measure(model: torch.nn.Module, batches: list[int], warmup: int, iters: int,
            device: torch.device) -> dict[int, dict[str, float]]:
    out = {}
    for batch in batches:
        inputs = harness.flux_inputs(model, 1024, batch, device)
        t0 = time.perf_counter()
        times = harness.time_steps(model, inputs, warmup, iters)
        out[batch] = {"ms": times.median, "first_s": time.perf_counter() - t0}
        harness.log(f"batch {batch}: {out[batch]['ms']:.1f} ms/step "
                   f"({out[batch]['first_s']:.0f} s incl. warm-up)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=19, help="double-stream blocks (Flux: 19)")
    p.add_argument("--single-layers", type=int, default=38, help="single-stream blocks (38)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--backend", default="inductor")
    p.add_argument("--dlo", action="store_true", help="stream every block (DLO)")
    p.add_argument("--slots", type=int, default=2, help="with --dlo: device slots (default 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--tiny", action="store_true",
                   help="small model on the CPU (use --backend aot_eager): smoke test")
    a = p.parse_args(argv)
    if a.tiny:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("needs a CUDA device (or --tiny)", file=sys.stderr)
        return 2
    model: Any = harness.build_flux(device, tiny=a.tiny, num_layers=a.layers,
                                    num_single_layers=a.single_layers)
    if a.dlo:
        model = model.cpu()
        enable_offload(model, OffloadConfig(enabled=True, slots=a.slots), device=device)
    blocks = a.layers + a.single_layers
    mode = f"DLO, {a.slots} slots" if a.dlo else "resident"
    harness.log(f"{blocks} blocks, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B "
               f"params, {mode}; eager")
    eager = measure(model, a.batches, a.warmup, a.iters, device)
    compile_repeated_blocks(model, a.backend)
    harness.log(f"compiled ({a.backend})")
    compiled = measure(model, a.batches, a.warmup, a.iters, device)
    rows = ["| batch | eager ms/step | compiled ms/step | compiled / eager | eager ms/block | "
            "compiled ms/block | first compiled batch s |", "|---|---|---|---|---|---|---|"]
    for b in a.batches:
        e, c = eager[b]["ms"], compiled[b]["ms"]
        rows.append(f"| {b} | {e:.1f} | {c:.1f} | {c / e:.3f} | {e / blocks:.2f} | "
                    f"{c / blocks:.2f} | {compiled[b]['first_s']:.0f} |")
    table = "\n".join(rows)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\n{gpu} torch {torch.__version__}, "
          f"{mode}, {blocks} blocks, 1024x1024\n\n{table}")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "compile.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(a).items()}, "eager": eager,
             "compiled": compiled}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
