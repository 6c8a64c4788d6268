#!/usr/bin/env python3
"""Z-Image at interactive latency (issue 47): one request on an idle replica against the bare
diffusers components, and DLO under ``auto`` against resident.

One full-size random Z-Image (``ditserve model init-random --size full --family z-image``,
every component at its released shape: the 6.15B DiT, Qwen3-4B, Flux's VAE; built on the GPU
into ``--model-dir`` when that holds no model). Two measurements, one process:

- bare: diffusers' own components, no serving around them: the prompt's encode
  (``ZImagePipeline.encode_prompt``), ``--steps`` DiT forwards at ``--size`` (the list
  interface, one image) and the VAE decode, each timed on its own (CUDA-synchronised, median
  of ``--repeats``); bare = encode + steps x step + decode;
- engine: the public engine (``DiffusionEngine``, the flags parsed by the engine's own option
  parser, as ``ditserve serve`` would) for each configuration, default ``resident``
  (``--offload none``) and ``dlo-auto`` (``--offload dlo --dlo-hbm-budget-gib auto``: a model
  that fits stays resident): one warm-up request, then ``--requests`` requests one after the
  other on the idle engine, each with its own prompt (no prompt-cache hit), latency from
  ``add_request`` to the result.

Targets: the resident request's median <= 1.10x bare; dlo-auto's median <= 1.00x resident's
(judged at 1.01: timing noise) with no block streamed. Prints a table; writes JSON to --out.

    python3 bench/z_image_latency.py --model-dir /dev/shm/z-image-full --out out/z-image

``--tiny`` runs the same program on the tiny model on a CPU (a smoke run: nothing judged).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import torch

from ditserve.engine.config.flags import add_engine_options, engine_config_from_args
from ditserve.engine.request import SamplingParams

CONFIGS = {"resident": "--offload none",
           "dlo-auto": "--offload dlo --dlo-hbm-budget-gib auto"}
LATENCY_BOUND = 1.10  # engine resident / bare
AUTO_BOUND = 1.01  # dlo-auto / resident (the target is 1.00x; 1% is timing noise)


def engine_config(flags: str, model: Path, device: str, dtype: str) -> Any:
    """An EngineConfig from engine flags, through the engine's own parser and validation."""
    import shlex

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_options(parser, with_config_file=False)
    parsed = parser.parse_args([*shlex.split(flags), "--model", str(model), "--device", device,
                                "--dtype", dtype])
    return engine_config_from_args(parsed)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` (after one warm-up call), synchronised on CUDA."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bare(model: Path, args: argparse.Namespace) -> dict[str, float]:
    """encode, one DiT step and decode of diffusers' own components (module docstring); the
    components are gone (and the device cache emptied) when it returns."""
    out = _bare(model, args)
    harness.release_device_cache()
    return out


def _bare(model: Path, args: argparse.Namespace) -> dict[str, float]:
    import diffusers

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    pipe = diffusers.ZImagePipeline.from_pretrained(model, torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    width, height = args.width, args.height
    factor = pipe.vae_scale_factor
    latent = (pipe.transformer.config.in_channels, 1, height // factor, width // factor)
    g = torch.Generator(device).manual_seed(0)
    image = torch.randn(latent, generator=g, device=device, dtype=dtype)
    with torch.inference_mode():
        (caption,), _ = pipe.encode_prompt("a lighthouse at dusk, photograph", device=device,
                                           do_classifier_free_guidance=False)
        t = torch.full((1,), 0.5, device=device)
        decode_in = torch.randn((1, latent[0], latent[2], latent[3]), generator=g,
                                device=device, dtype=pipe.vae.dtype)
        out = {
            "encode_s": timed(lambda: pipe.encode_prompt(
                "a lighthouse at dusk, photograph", device=device,
                do_classifier_free_guidance=False), device, args.repeats),
            "step_s": timed(lambda: pipe.transformer([image], t, [caption], return_dict=False),
                            device, args.repeats),
            "decode_s": timed(lambda: pipe.vae.decode(decode_in, return_dict=False), device,
                              args.repeats),
        }
    out["bare_s"] = out["encode_s"] + args.steps * out["step_s"] + out["decode_s"]
    return out


def engine_run(name: str, flags: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    from ditserve.engine.loop.engine import DiffusionEngine
    from ditserve.engine.server.model_defaults import model_defaults

    harness.log(f"{name}: loading ({flags})")
    engine = DiffusionEngine(engine_config(flags, model, args.device, args.dtype)).start()
    defaults = model_defaults(model)
    try:
        def one(i: int) -> float:
            params = SamplingParams(prompt=f"request {i}: a lighthouse at dusk, photograph",
                                    height=args.height, width=args.width,
                                    num_inference_steps=args.steps,
                                    guidance_scale=defaults.guidance, seed=i + 1)
            started = time.perf_counter()
            engine.add_request(params).result()
            return time.perf_counter() - started

        one(-1)  # warm-up: first use of the size (its own prompt, seed 0)
        latencies = [one(i) for i in range(args.requests)]
        report = engine.offload_report() or {}
    finally:
        engine.shutdown()
        harness.release_device_cache()
    return {"flags": flags, "latencies_s": latencies,
            "median_s": statistics.median(latencies), "max_s": max(latencies),
            "streamed_blocks": report.get("streamed_blocks")}


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    resident, auto = r["configs"].get("resident"), r["configs"].get("dlo-auto")
    if resident and r.get("bare"):
        ratio = resident["median_s"] / r["bare"]["bare_s"]
        rows.append({"target": f"idle request <= {LATENCY_BOUND}x bare steps + encode + decode",
                     "ratio": ratio, "met": ratio <= LATENCY_BOUND})
    if resident and auto:
        ratio = auto["median_s"] / resident["median_s"]
        rows.append({"target": "DLO auto b1 == 1.00x resident, nothing streamed",
                     "ratio": ratio,
                     "met": ratio <= AUTO_BOUND and not auto["streamed_blocks"]})
    return rows


def prepare_model(args: argparse.Namespace, scratch: Path) -> Path:
    if args.tiny:
        from ditserve.engine.makers.tiny_model import init_tiny

        return init_tiny(scratch / "tiny-z-image", family="z-image")
    model = args.model_dir or Path("/dev/shm/ditserve-z-image-full")
    if not (model / "model_index.json").exists():
        from ditserve.engine.makers.random_model import init_random

        harness.log(f"building the full-size model in {model}")
        init_random(model, family="z-image", size="full", components="all", device="cuda")
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--size", default="1024x1024", help="WIDTHxHEIGHT")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--requests", type=int, default=5, help="timed requests per configuration")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per bare component")
    p.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    p.add_argument("--tiny", action="store_true", help="the tiny model on a CPU (smoke run)")
    p.add_argument("--out", type=Path, default=Path("out/z-image-latency"))
    args = p.parse_args(argv)
    if args.tiny:
        args.size, args.steps, args.requests, args.repeats = "32x32", 2, 2, 2
        args.device, args.dtype = "cpu", "float32"
        args.configs = [c for c in args.configs if c == "resident"]  # auto needs CUDA
    else:
        if not torch.cuda.is_available():
            p.error("a full-size run needs a CUDA device (or --tiny on a CPU)")
        args.device, args.dtype = "cuda", "bfloat16"
    args.width, args.height = (int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory() as scratch:
        model = prepare_model(args, Path(scratch))
        result: dict[str, Any] = {"size": args.size, "steps": args.steps,
                                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                  "bare": bare(model, args), "configs": {}}
        for name in args.configs:
            result["configs"][name] = engine_run(name, CONFIGS[name], model, args)
    result["targets"] = [] if args.tiny else targets(result)
    b = result["bare"]
    print(f"bare: encode {b['encode_s'] * 1e3:.1f} ms, step {b['step_s'] * 1e3:.1f} ms x "
          f"{args.steps}, decode {b['decode_s'] * 1e3:.1f} ms = {b['bare_s'] * 1e3:.1f} ms")
    for name, c in result["configs"].items():
        print(f"{name:<10} median {c['median_s'] * 1e3:.1f} ms, max {c['max_s'] * 1e3:.1f} ms, "
              f"streamed blocks {c['streamed_blocks']}")
    for t in result["targets"]:
        print(f"  {t['target']:<58} {t['ratio']:.3f}x  {'ok' if t['met'] else 'NO'}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"z_image_latency_{'tiny' if args.tiny else 'full'}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
