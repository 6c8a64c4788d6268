#!/usr/bin/env python3
"""Checkpoint formats under layerwise offload: a full-size random Flux DiT as stored in bf16, GGUF
Q8_0, GGUF Q4_K and FP8, each streamed in its stored form (issue 49).

For each format: write the file from the diffusers folder (``ditserve model convert``; reused if
present), load the DiT from it as the engine does (``weights.dit_file``), enable DLO with every
block streamed, and time batch-1 denoise forwards at ``--res`` (CUDA events, median). The
format's floor is its streamed bytes per step over the measured pinned H2D bandwidth; the
target is ``DLO b1 <= 1.05 x floor``. With ``--resident``, the same DiT is also timed resident
(GGUF: quantized, dequantized per layer on the device) against diffusers' own GGUF path
(``from_single_file`` + ``GGUFQuantizationConfig``; target within 1.10x).

Disk: the bf16 folder (~24 GB) plus one converted file at a time (Q8_0 ~12.7 GB, Q4_K ~6.8 GB,
FP8 ~12 GB; deleted after its row unless ``--keep-files``). Host memory: one DiT loaded and
pinned at a time (<= ~50 GB while converting).

    ditserve model init-random /data/flux-full --size full --components dit
    python3 bench/formats.py --model-dir /data/flux-full --out $OUT/formats
    python3 bench/formats.py --model-dir /data/flux-full --formats gguf:Q4_K --resident --out $OUT
    python3 bench/formats.py --model-dir /data/flux-full --formats gguf:Q8_0 --dequant compute slot
    python3 bench/formats.py --tiny --model-dir /tmp/flux-tiny --out /tmp/formats  # CPU smoke

``--dequant``: where GGUF layers dequantize under DLO (``--dlo-dequant``): each mode given is
its own row for a GGUF format ("gguf:Q8_0" compute, "gguf:Q8_0+slot"); other formats run once.
``--slots``: DLO slot counts, a row per count ("gguf:Q8_0+3slots"): with two slots a step is
about the sum over blocks of max(copy, compute), which exceeds both sums where some blocks copy
longer than they compute and others the reverse; a third slot lets the copy run ahead.
``--compile``: each row is timed again with the blocks compiled as ``--compile`` serves them
("fp8+compiled"): eager FP8 quantizes each linear's activations in separate kernels, which
makes a b1 step compute-bound at half the bytes; compiled, inductor fuses them. With
``--resident`` too, the resident DiT is also timed compiled, and each compiled row gets a second
target, ``DLO b1 <= 1.05 x max(floor, resident)``: where a format's resident step is longer
than its copies (Q4_K's dequantization), no streaming schedule gets below the resident step.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import harness
import torch

from ditserve.engine.config import DEQUANT_MODES, OffloadConfig
from ditserve.engine.offload import enable_offload
from ditserve.engine.offload.builders import DEFAULT_SLOTS
from ditserve.engine.runner.compiled_blocks import compile_repeated_blocks
from ditserve.engine.weights.convert import convert
from ditserve.engine.weights.dit_file import load_dit_file
from ditserve.engine.weights.loader import load_dit

FORMATS = ("bf16", "gguf:Q8_0", "gguf:Q4_K", "fp8")
FLOOR_BOUND = 1.05
RESIDENT_BOUND = 1.10


def log(msg: str) -> None:
    print(f"[formats] {msg}", file=sys.stderr, flush=True)


def file_for(work: Path, fmt: str) -> Path:
    kind, _, qtype = fmt.partition(":")
    return work / (f"flux-{qtype}.gguf" if kind == "gguf" else f"flux-{fmt}.safetensors")


def load_format(model_dir: Path, work: Path, fmt: str, result: dict[str, Any]) -> Any:
    """The DiT of ``fmt`` on the CPU, converting its file first if needed."""
    if fmt == "bf16":
        return load_dit(model_dir, dtype="bfloat16")
    path = file_for(work, fmt)
    if not path.exists():
        t0 = time.monotonic()
        convert(model_dir, path, to=fmt)
        result["convert_s"] = time.monotonic() - t0
        log(f"{fmt}: wrote {path} in {result['convert_s']:.0f}s")
    result["file_bytes"] = path.stat().st_size
    t0 = time.monotonic()
    dit = load_dit_file(path, model_dir, dtype="bfloat16")
    result["load_s"] = time.monotonic() - t0
    return dit


def time_forwards(model: Any, device: torch.device, args: argparse.Namespace) -> float:
    inputs = harness.flux_inputs(model, args.res, 1, device)
    return harness.time_steps(model, inputs, args.warmup, args.iters).median


def run_format(fmt: str, args: argparse.Namespace, device: torch.device, gbps: float
               ) -> list[dict[str, Any]]:
    """The format's row (and, for GGUF with several ``--dequant`` modes, one row per mode)."""
    result: dict[str, Any] = {"format": fmt}
    dit = load_format(args.model_dir, args.work, fmt, result)
    modes = args.dequant if fmt.startswith("gguf:") else ["compute"]
    rows = []
    for mode, slots in ((m, n) for m in modes for n in args.slots):
        # A row per (mode, slots): more slots let the copy run further ahead where some
        # blocks copy longer than they compute and others the reverse.
        label = (fmt if mode == "compute" else f"{fmt}+{mode}") + (
            "" if slots == DEFAULT_SLOTS else f"+{slots}slots")
        row = dict(result, format=label, dequant=mode, slots=slots)
        handle = enable_offload(dit, OffloadConfig(enabled=True, dequant=mode, slots=slots),
                                device=device)
        report = handle.snapshot().to_json()
        row["streamed_bytes"] = report["streamed_bytes"]
        row["slot_bytes"] = report["slot_bytes"]
        row["dlo_ms"] = time_forwards(dit, device, args)
        row["floor_ms"] = report["streamed_bytes"] / (gbps * 1e9) * 1e3
        row["dlo_over_floor"] = row["dlo_ms"] / row["floor_ms"]
        rows.append(row)
        if args.compile:
            # The same offload with the blocks compiled: to dynamo a slot view is just another
            # input, so the streamed blocks trace as they run.
            compile_repeated_blocks(dit, args.compile_backend)
            t0 = time.monotonic()
            try:
                compiled_ms = time_forwards(dit, device, args)
            except Exception as e:  # one format failing to compile must not lose the others
                log(f"{label}+compiled: {type(e).__name__}: {e}")
                row["compile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            else:
                rows.append(dict(row, format=f"{label}+compiled", compiled=True,
                                 dlo_ms=compiled_ms, compile_and_time_s=time.monotonic() - t0,
                                 dlo_over_floor=compiled_ms / row["floor_ms"]))
            harness.uncompile_blocks(dit)
        handle.disable()
        for r in rows[-(2 if rows[-1].get("compiled") else 1):]:
            log(f"{r['format']}: DLO b1 {r['dlo_ms']:.1f} ms, floor {r['floor_ms']:.1f} ms "
                f"({r['streamed_bytes'] / 2**30:.2f} GiB/step)")
    result = rows[0]
    if args.resident and device.type == "cuda":
        dit.to(device)
        result["resident_ms"] = time_forwards(dit, device, args)
        if args.compile:
            # What a compiled DLO step can reach where the step is compute-bound: the same
            # blocks compiled and resident (no copies at all).
            compile_repeated_blocks(dit, args.compile_backend)
            resident_compiled_ms = time_forwards(dit, device, args)
            for r in rows:
                if r.get("compiled"):
                    r["resident_ms"] = resident_compiled_ms
            harness.uncompile_blocks(dit)
        del dit
        harness.release_device_cache()
        if fmt.startswith("gguf:"):
            result["diffusers_resident_ms"] = diffusers_gguf_ms(fmt, args, device)
    else:
        del dit
    gc.collect()
    if fmt != "bf16" and not args.keep_files:
        file_for(args.work, fmt).unlink(missing_ok=True)
    return rows


def diffusers_gguf_ms(fmt: str, args: argparse.Namespace, device: torch.device) -> float:
    """diffusers' own GGUF path, resident: its Flux converter and ``GGUFLinear`` layers."""
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    model = FluxTransformer2DModel.from_single_file(
        str(file_for(args.work, fmt)), config=str(args.model_dir), subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.bfloat16),
        torch_dtype=torch.bfloat16).to(device)
    ms = time_forwards(model, device, args)
    del model
    harness.release_device_cache()
    return ms


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    bf16 = next((r for r in rows if r["format"] == "bf16"), None)
    for r in rows:
        out.append({"target": f"{r['format']} DLO b1 <= {FLOOR_BOUND} x its floor",
                    "value": r["dlo_ms"], "bound": FLOOR_BOUND * r["floor_ms"],
                    "ok": r["dlo_ms"] <= FLOOR_BOUND * r["floor_ms"]})
        if r.get("compiled") and "resident_ms" in r:
            # A step is bounded by its copies and by its compute, whichever is longer: where
            # the resident step is above the floor, this is the bound the step can reach.
            reach = max(r["floor_ms"], r["resident_ms"])
            out.append({"target": f"{r['format']} DLO b1 <= {FLOOR_BOUND} x max(floor, resident)",
                        "value": r["dlo_ms"], "bound": FLOOR_BOUND * reach,
                        "ok": r["dlo_ms"] <= FLOOR_BOUND * reach})
        if bf16 is not None and r is not bf16:
            r["floor_vs_bf16"] = r["streamed_bytes"] / bf16["streamed_bytes"]
        if "diffusers_resident_ms" in r:
            bound = RESIDENT_BOUND * r["diffusers_resident_ms"]
            out.append({"target": f"{r['format']} resident <= {RESIDENT_BOUND} x diffusers GGUF",
                        "value": r["resident_ms"], "bound": bound,
                        "ok": r["resident_ms"] <= bound})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    header = ["format", "file GiB", "streamed GiB/step", "x bf16", "floor ms", "DLO b1 ms",
              "DLO / floor", "resident ms", "diffusers GGUF resident ms"]

    def f(v: Any, fmt: str = ".1f") -> str:
        return "-" if v is None else format(v, fmt)

    lines = harness.md_table(header, [
        [r["format"], f(r.get("file_bytes") and r["file_bytes"] / 2**30, ".2f"),
         f(r["streamed_bytes"] / 2**30, ".2f"), f(r.get("floor_vs_bf16"), ".2f"),
         f(r["floor_ms"]), f(r["dlo_ms"]), f(r["dlo_over_floor"], ".3f"),
         f(r.get("resident_ms")), f(r.get("diffusers_resident_ms"))] for r in rows])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--model-dir", type=Path, required=True,
                   help="a Flux diffusers folder (made with init-random if absent)")
    p.add_argument("--work", type=Path, default=None,
                   help="where converted files go (default: beside --model-dir)")
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--resident", action="store_true",
                   help="also time each DiT resident (and diffusers' GGUF path)")
    p.add_argument("--dequant", nargs="+", choices=DEQUANT_MODES, default=["compute"],
                   help="GGUF: where layers dequantize under DLO, a row per mode")
    p.add_argument("--slots", nargs="+", type=int, default=[DEFAULT_SLOTS],
                   help="DLO slot counts, a row per count (default: the engine's)")
    p.add_argument("--compile", action="store_true",
                   help="also time each row with the blocks compiled (a '+compiled' row)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend for --compile (aot_eager: a CPU smoke run)")
    p.add_argument("--keep-files", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a tiny DiT on the CPU (smoke run)")
    p.add_argument("--out", type=Path, default=Path("out/formats"))
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("bench/formats.py needs a CUDA device (or --tiny on a CPU)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    args.work = args.work or args.model_dir.parent / f"{args.model_dir.name}-formats"
    args.work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        args.res, args.warmup, args.iters = min(args.res, 64), 0, 1
    if not (args.model_dir / "model_index.json").exists():
        from ditserve.engine.makers.random_model import init_random

        init_random(args.model_dir, family="flux", size="tiny" if args.tiny else "full",
                    components="dit", device="cuda" if cuda else "cpu")
    h2d = harness.measure_h2d(device)
    # On a CPU there is no transfer to bound: a nominal 1 GB/s keeps the smoke run's sums real.
    gbps = h2d["registered_gbps"] if cuda else 1.0
    rows = [row for fmt in args.formats for row in run_format(fmt, args, device, gbps)]
    result = {"environment": harness.environment(device), "h2d": h2d, "rows": rows,
              "targets": targets(rows)}
    args.out.mkdir(parents=True, exist_ok=True)
    harness.write_json(args.out / "formats.json", result)
    text = table(rows) + "\n\n" + "\n".join(
        f"- {t['target']}: {t['value']:.1f} vs {t['bound']:.1f} ms -> "
        f"{'ok' if t['ok'] else 'MISSED'}" for t in result["targets"])
    (args.out / "formats.md").write_text(text + "\n")
    print(text)
    print(json.dumps({"h2d_gbps": gbps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
