#!/usr/bin/env python3
"""Output quality of lossy speed-ups against the exact run: FP8 against bf16 (default), or
the step cache against no cache (``--step-cache``), per model family.

**Step cache** (``--step-cache``): the engine's own runner (resident) generates every prompt
and seed without a cache, then with each policy and setting (``--policies``, default: the
published knobs around their defaults); per setting it reports the fraction of block
computations skipped and the difference to the uncached output on the same seeds (mean
absolute pixel difference in 8-bit levels, PSNR). Random weights are not trained weights:
neither the skip fraction at a threshold nor the error predicts a real checkpoint's.

**FP8**:

Takes a local diffusers directory; the family comes from its ``model_index.json``'s
``_class_name``, looked up in the family registry (``engine.families``).
For each fixed prompt and seed:

1. the bf16 pipeline runs end to end; every transformer call's inputs and output are kept;
2. the transformer is quantized in place (``engine.formats.fp8_select.quantize_fp8``: the
   engine's FP8 rule; ``--keep-modulation`` keeps the adaLN modulation linears in bf16);
3. **per step**, the FP8 transformer gets the *same* inputs as the bf16 one had (so error does
   not compound along the trajectory) and its output's relative L2 error
   ``||fp8 - bf16|| / ||bf16||`` is reported;
4. the FP8 pipeline runs end to end from the same seed; PSNR (dB, images in [0, 1]) and SSIM
   (Gaussian window 11, sigma 1.5, as Wang et al. 2004) of its images against the bf16 ones.

Random weights are not trained weights: on a random model these numbers measure the FP8
arithmetic on this architecture, not the image quality of a trained model; the output says
which kind of weights it measured. CUDA uses ``torch._scaled_mm``; CPU the emulated path.

    python3 bench/quality.py --model /models/flux-random-full      # one H200, bf16, 1024x1024
    python3 bench/quality.py --tiny                                # CPU smoke (CI)
    python3 bench/quality.py --step-cache --model /models/flux-random-full --out sc.json
    python3 bench/quality.py --step-cache --tiny                   # CPU smoke (CI)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ditserve.engine.families import family_of_pipeline, supported_pipelines
from ditserve.engine.sched.work import ResolvedScheduling

PROMPTS = ("a red fox in fresh snow, morning light", "a lighthouse on a cliff at dusk, oil painting")
RANDOM_MARKERS = (".ditserve-tiny-complete", ".ditserve-random-complete")


def log(msg: str) -> None:
    print(msg, flush=True)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(F.mse_loss(a.double(), b.double()))
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def ssim(a: torch.Tensor, b: torch.Tensor, *, sigma: float = 1.5, size: int = 11) -> float:
    """Mean SSIM of (N, C, H, W) images in [0, 1] over the window's valid positions."""
    a, b = a.double(), b.double()
    size = min(size, *a.shape[-2:])
    size -= 1 - size % 2  # odd, so the window has a centre
    x = torch.arange(size, dtype=torch.float64) - size // 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    g = g / g.sum()
    channels = a.shape[1]
    window = (g[:, None] * g[None, :]).expand(channels, 1, size, size)

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, window, groups=channels)

    c1, c2 = 0.01**2, 0.03**2
    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    num = (2 * mu_a * mu_b + c1) * (2 * cov + c2)
    den = (mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2)
    return float((num / den).mean())


def relative_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def weights_kind(model_dir: Path) -> str:
    for marker in RANDOM_MARKERS:
        path = model_dir / marker
        if path.is_file() and json.loads(path.read_text() or "{}").get("random_weights"):
            return "random"
    return "as found (not marked random)"


def family_of(model_dir: Path) -> str:
    index = json.loads((model_dir / "model_index.json").read_text())
    cls = index.get("_class_name")
    family = family_of_pipeline(cls)
    if family is None:
        raise SystemExit(f"{model_dir}: pipeline {cls!r} is not one of "
                         f"{', '.join(supported_pipelines())}")
    return family.name


def call_kwargs(family: str, pipe: Any, args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(height=args.height, width=args.width,
                                  num_inference_steps=args.steps, output_type="np")
    if family == "flux":
        t5_max = int(getattr(pipe.tokenizer_2, "model_max_length", 512))
        kwargs.update(guidance_scale=3.5, max_sequence_length=min(512, t5_max))
    elif family == "wan":
        kwargs.update(num_frames=args.frames, guidance_scale=5.0)
    return kwargs


class CallRecorder:
    """Keeps every transformer call's inputs and output (detached copies)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any], torch.Tensor]] = []
        self._pending: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._handles = [module.register_forward_pre_hook(self._pre, with_kwargs=True),
                         module.register_forward_hook(self._post)]

    @staticmethod
    def _copy(value: Any) -> Any:
        return value.detach().clone() if isinstance(value, torch.Tensor) else value

    def _pre(self, _m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._pending = (tuple(self._copy(a) for a in args),
                         {k: self._copy(v) for k, v in kwargs.items()})

    def _post(self, _m: Any, _args: Any, output: Any) -> None:
        sample = output[0] if isinstance(output, tuple) else output.sample
        assert self._pending is not None
        self.calls.append((*self._pending, sample.detach().clone()))
        self._pending = None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def as_images(output: Any) -> torch.Tensor:
    """Pipeline output (images or video frames, numpy in [0, 1]) as (N, C, H, W)."""
    array = output.frames if hasattr(output, "frames") else output.images
    t = torch.as_tensor(array).float()
    return t.reshape(-1, *t.shape[-3:]).permute(0, 3, 1, 2)


def replay(transformer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The transformer's output for recorded inputs (the bf16 run's, at the same step)."""
    kwargs = {**kwargs, "return_dict": False}
    with torch.inference_mode():
        return transformer(*args, **kwargs)[0]


def run(pipe: Any, prompt: str, seed: int, kwargs: dict[str, Any], device: str) -> torch.Tensor:
    generator = torch.Generator(device="cpu" if device == "cpu" else device).manual_seed(seed)
    with torch.inference_mode():
        return as_images(pipe(prompt=prompt, generator=generator, **kwargs))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="local diffusers pipeline directory")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke: the tiny Flux (built if --model is not given), fp32, 2 steps")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--frames", type=int, default=17, help="wan: frames per video")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--prompts", nargs="+", default=list(PROMPTS))
    p.add_argument("--keep-modulation", action="store_true",
                   help="leave the adaLN modulation linears in bf16")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--step-cache", action="store_true",
                   help="measure the step cache's policies against no cache instead of FP8")
    p.add_argument("--policies", nargs="+", default=None, metavar="POLICY:V,V",
                   help="settings to measure, e.g. first-block:0.05,0.08 teacache:0.4 every:2,3")
    args = p.parse_args(argv)
    if args.tiny and args.step_cache:
        args.device, args.dtype = args.device or "cpu", args.dtype or "float32"
        args.steps, args.height, args.width = 8, 32, 32
        args.seeds, args.prompts, args.frames = args.seeds[:1], args.prompts[:1], 5
    elif args.tiny:
        args.device, args.dtype = args.device or "cpu", args.dtype or "float32"
        args.steps, args.height, args.width = 2, 32, 32
        args.seeds, args.prompts, args.frames = args.seeds[:1], args.prompts[:1], 5
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model
        if model_dir is None:
            if not args.tiny:
                p.error("--model is required (or --tiny)")
            from ditserve.engine.makers.tiny_model import init_tiny

            model_dir = init_tiny(Path(scratch) / "tiny-flux")
        measure_fn = measure_step_cache if args.step_cache else measure
        result = measure_fn(Path(model_dir), args, device=device, dtype=dtype)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


def measure(model_dir: Path, args: argparse.Namespace, *, device: str,
            dtype: torch.dtype) -> dict[str, Any]:
    import transformers
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as diffusers_logging

    from ditserve.engine.formats.fp8_select import FP8Rule, quantize_fp8

    family, kind = family_of(model_dir), weights_kind(model_dir)
    reference_name = str(dtype).removeprefix("torch.")  # what FP8 is compared against
    log(f"quality: {family} from {model_dir.name}, {dtype} on {device}, {args.steps} steps, "
        f"{args.width}x{args.height}; FP8 rule: block linears"
        f"{' except modulation' if args.keep_modulation else ''}")
    log(f"weights: {kind}. Random weights are not trained weights: these numbers measure FP8 "
        "arithmetic on this architecture, not the image quality of a trained model.")
    diffusers_logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    pipe = DiffusionPipeline.from_pretrained(str(model_dir), dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    kwargs = call_kwargs(family, pipe, args)
    cases = [(i, prompt, seed) for i, prompt in enumerate(args.prompts) for seed in args.seeds]
    reference: dict[tuple[int, int], tuple[torch.Tensor, list[Any]]] = {}
    t0 = time.perf_counter()
    for i, prompt, seed in cases:
        recorder = CallRecorder(pipe.transformer)
        images = run(pipe, prompt, seed, kwargs, device)
        recorder.remove()
        reference[(i, seed)] = (images, recorder.calls)
    bf16_s = time.perf_counter() - t0
    report = quantize_fp8(pipe.transformer, FP8Rule(include_modulation=not args.keep_modulation))
    rows = []
    for i, prompt, seed in cases:
        images, calls = reference[(i, seed)]
        steps = [relative_l2(replay(pipe.transformer, a, kw), out) for a, kw, out in calls]
        fp8_images = run(pipe, prompt, seed, kwargs, device)
        rows.append({"prompt": i, "seed": seed, "step_rel_l2": steps,
                     "psnr_db": psnr(fp8_images, images), "ssim": ssim(fp8_images, images)})
        log(f"prompt {i} seed {seed}: transformer rel L2 per step mean "
            f"{statistics.mean(steps) * 100:.2f}% max {max(steps) * 100:.2f}% "
            f"({len(steps)} calls); image PSNR {rows[-1]['psnr_db']:.2f} dB "
            f"SSIM {rows[-1]['ssim']:.4f}")
    summary = {
        "family": family, "weights": kind, "reference_dtype": reference_name, "device": device,
        "steps": args.steps, "size": [args.width, args.height],
        "keep_modulation": args.keep_modulation, "quantized": report.to_dict(),
        "bf16_run_s": round(bf16_s, 2),
        "mean_step_rel_l2": statistics.mean(s for r in rows for s in r["step_rel_l2"]),
        "mean_psnr_db": statistics.mean(r["psnr_db"] for r in rows),
        "mean_ssim": statistics.mean(r["ssim"] for r in rows), "cases": rows,
    }
    log(f"{family}: FP8 vs {reference_name} over {len(rows)} image(s): step rel L2 "
        f"{summary['mean_step_rel_l2'] * 100:.2f}%, PSNR {summary['mean_psnr_db']:.2f} dB, "
        f"SSIM {summary['mean_ssim']:.4f}; {report.layers} linears, weight bytes "
        f"{report.bf16_bytes / 1e6:.1f} -> {report.fp8_bytes / 1e6:.1f} MB ({kind} weights)")
    return summary


DEFAULT_SETTINGS = ("first-block:0.05,0.08,0.12,0.2", "teacache:0.25,0.4,0.6", "every:2,3,4")


def settings(specs: list[str]) -> list[tuple[str, float]]:
    out = []
    for spec in specs:
        policy, _, values = spec.partition(":")
        out += [(policy, float(v)) for v in values.split(",") if v]
    return out


def measure_step_cache(model_dir: Path, args: argparse.Namespace, *, device: str,
                       dtype: torch.dtype) -> dict[str, Any]:
    from ditserve.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
    from ditserve.engine.config.step_cache import StepCacheSpec
    from ditserve.engine.errors import InvalidRequestError
    from ditserve.engine.request import NewRequest, SamplingParams
    from ditserve.engine.runner.model_runner import ModelRunner
    from ditserve.engine.sched.scheduler import StepScheduler

    family, kind = family_of(model_dir), weights_kind(model_dir)
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model_dir), device=device,
                                                      dtype=str(dtype).removeprefix("torch."))),
                         model_dir=model_dir)
    log(f"step cache quality: {family} ({kind} weights), {args.steps} steps, "
        f"{args.width}x{args.height}, {dtype} on {device}. Random weights do not predict a "
        "trained checkpoint's skip fraction or error at a given threshold.")
    extra = {"num_frames": args.frames, "guidance_scale": 5.0} if family == "wan" else {}

    def generate(spec: StepCacheSpec | None) -> tuple[list[torch.Tensor], int, int]:
        pixels, skipped, runs = [], 0, 0
        for prompt in args.prompts:
            for seed in args.seeds:
                params = SamplingParams(prompt=prompt, height=args.height, width=args.width,
                                        num_inference_steps=args.steps, seed=seed,
                                        step_cache=spec, **extra)
                scheduler = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1)))
                scheduler.add("q", params, runner.work_rule.of(params))
                new, done = [NewRequest("q", params, seed)], {}
                while scheduler.has_work():
                    plan = scheduler.schedule()
                    out = runner.execute(plan, new)
                    new = []
                    scheduler.update(plan, out)
                    skipped += out.step_cache_skipped_blocks
                    runs += out.step_cache_block_runs
                    done.update(out.finished)
                pixels.append(torch.as_tensor(done["q"]).float().reshape(-1, *done["q"].shape[-3:]))
        return pixels, skipped, runs

    reference, _, _ = generate(None)
    rows = []
    for policy, value in settings(args.policies or list(DEFAULT_SETTINGS)):
        spec = (StepCacheSpec("every", every=int(value)) if policy == "every"
                else StepCacheSpec(policy, threshold=value))
        try:
            runner.step_cache.check(spec)
        except InvalidRequestError as e:
            log(f"{policy} {value:g}: skipped ({e.message})")
            continue
        images, skipped, runs = generate(spec)
        diff = [float((a - b).abs().mean()) * 255 for a, b in zip(images, reference, strict=True)]
        row = {"policy": policy, "value": value, "skipped_fraction": skipped / max(1, runs),
               "mean_abs_pixel_diff": statistics.mean(diff),
               "psnr_db": statistics.mean(psnr(a, b) for a, b in zip(images, reference,
                                                                     strict=True))}
        row["psnr_db"] = None if math.isinf(row["psnr_db"]) else row["psnr_db"]  # JSON: identical
        rows.append(row)
        log(f"{policy:>11} {value:>5g}: skipped {row['skipped_fraction']:6.1%} of block "
            f"computations | mean abs diff {row['mean_abs_pixel_diff']:6.2f} / 255 | "
            f"PSNR {'inf' if row['psnr_db'] is None else format(row['psnr_db'], '6.2f')} dB")
    runner.close()
    return {"family": family, "weights": kind, "device": device, "steps": args.steps,
            "size": [args.width, args.height], "cases": len(reference), "settings": rows}


if __name__ == "__main__":
    raise SystemExit(main())
