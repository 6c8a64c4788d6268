"""`ditserve demo`: six text-only requests of different step counts through one engine at once,
the continuous batching made visible (steps run against the unbatched count), their outputs
saved, and a summary table. By default on the embedded tiny Flux; with ``--model`` on that
model, said so in the banner and saved as what it makes (an MP4 per video)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ditserve.engine.config.flags import engine_config_from_args
from ditserve.engine.errors import ConfigError, InvalidRequestError

DEMO_PROMPTS = [
    "a red fox in fresh snow", "a lighthouse at dusk", "a bowl of ramen, studio light",
    "an astronaut riding a horse", "a watercolor city skyline", "a macro photo of a bee",
]
DEMO_STEPS = [4, 8, 2, 6, 4, 3]


def cmd_demo(args: argparse.Namespace) -> int:
    from ditserve.engine.loop.engine import DiffusionEngine
    from ditserve.engine.request import SamplingParams
    from ditserve.engine.server.model_defaults import model_defaults

    config = engine_config_from_args(args)
    defaults = model_defaults(config.model)
    video = defaults.output == "video" and not defaults.still_images
    what = ("a tiny random-weight Flux model (images are noise-like by design)"
            if config.model is None else f"the model in {config.model}")
    print(f"ditserve demo: {what}; {len(DEMO_PROMPTS)} concurrent requests with different step "
          f"counts, max_num_seqs={config.scheduler.max_num_seqs}")
    engine = DiffusionEngine(config).start()
    try:
        started = time.perf_counter()
        try:
            handles = [
                engine.add_request(SamplingParams(
                    prompt=p, num_inference_steps=s, seed=i, height=args.size, width=args.size,
                    num_frames=defaults.frames if video else 1))
                for i, (p, s) in enumerate(zip(DEMO_PROMPTS, DEMO_STEPS, strict=True))
            ]
        except InvalidRequestError as e:
            raise ConfigError(f"demo sends text-only requests, which this model cannot run "
                              f"({e}); use `ditserve generate` (--image ...) or `serve`") from e
        results = [h.result(timeout=600) for h in handles]
        elapsed = time.perf_counter() - started
        stats = engine.stats()
    finally:
        engine.shutdown()
    _report(results, args.out_dir, fps=defaults.fps if video else None, elapsed=elapsed,
            stats=stats)
    return 0


def _report(results: list[Any], out_dir: Path, *, fps: int | None, elapsed: float,
            stats: Any) -> None:
    """Save each request's output (an MP4 per video at ``fps``, else its image) and print the
    table and the batching summary."""
    from ditserve.engine.media.video import write_mp4

    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"\n{'request':<8} {'steps':>5} {'seed':>5} {'queue s':>8} {'latency s':>9}  output")
    for i, r in enumerate(results):
        if fps is not None:
            path = write_mp4(r.pixels[0], out_dir / f"demo-{i}.mp4", fps=fps)
        else:
            path = out_dir / f"demo-{i}.png"
            r.images[0].save(path)
        print(f"{i:<8} {r.num_inference_steps:>5} {r.seed:>5} {r.queue_seconds:>8.3f} "
              f"{r.latency_seconds:>9.3f}  {path}")
    outputs = sum(r.num_images for r in results)
    kind = "videos" if fps is not None else "images"
    print(f"\nrequests {len(results)} | denoise steps run {stats.steps_run} "
          f"(vs {sum(DEMO_STEPS)} unbatched) | mean batch size {stats.mean_batch_rows:.2f} | "
          f"{outputs / elapsed:.2f} {kind}/s | wall {elapsed:.2f}s")
    if stats.step_cache_block_runs:
        print(f"step cache: skipped {stats.step_cache_skipped_blocks} of "
              f"{stats.step_cache_block_runs} block computations, "
              f"{stats.step_cache_skipped_bytes} streamed bytes not copied")
