"""What Cosmos3's tests share: its reference requests and diffusers' Cosmos3OmniPipeline on
the same tiny model, and a step run by hand over its shape groups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from families import family_support  # type: ignore[import-not-found]

from ditserve.engine.request import ConditionImage, SamplingParams
from ditserve.engine.runner.group_forwards import shape_groups
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.step.denoise_state import DenoiseState

VARIANT = "cosmos3"


def picture(width: int, height: int, seed: int) -> ConditionImage:
    rng = np.random.default_rng(seed)
    return ConditionImage(width, height, rng.integers(0, 256, (height, width, 3),
                                                      dtype=np.uint8).tobytes())


BASE = {"height": 64, "width": 64}
CASES: dict[str, SamplingParams] = {
    "t2v-cfg": SamplingParams(prompt="a red cat", negative_prompt="fog", num_frames=5,
                              num_inference_steps=3, seed=7, guidance_scale=4.0, **BASE),
    "t2v-plain": SamplingParams(prompt="waves on a beach", num_frames=9, guidance_scale=1.0,
                                num_inference_steps=4, seed=9, height=32, width=96),
    "t2i": SamplingParams(prompt="a lighthouse", num_frames=1, num_inference_steps=3, seed=5,
                          guidance_scale=3.0, **BASE),
    "i2v": SamplingParams(prompt="the cat walks", negative_prompt="blur", num_frames=5,
                          num_inference_steps=3, seed=3, guidance_scale=5.0,
                          images=(picture(80, 48, 1),), **BASE),
    "sound": SamplingParams(prompt="rain on a roof", num_frames=5, num_inference_steps=3,
                            seed=4, guidance_scale=2.0, audio=True, **BASE),
}


def run_pipeline(runner: ModelRunner, requests: Sequence[tuple[str, SamplingParams]]
                 ) -> dict[str, DenoiseState]:
    """The requests through the pipeline by hand, one forward per step and shape group (as
    the runner groups them), with the sound track."""
    return family_support.run_pipeline(runner, requests, groups=shape_groups)


def reference(model_dir: Any, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    import diffusers

    pipe = diffusers.Cosmos3OmniPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    return reference_on(pipe, p)  # (1, F, 3, H, W), (channels, samples)


def reference_on(pipe: Any, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """diffusers' call on an already loaded (and placed) pipeline, as ``reference``."""
    from PIL import Image

    image = None
    if p.images:
        i = p.images[0]
        image = Image.frombytes("RGB", (i.width, i.height), i.rgb)
    out = pipe(p.prompt, negative_prompt=p.negative_prompt, image=image,
               num_frames=p.num_frames, height=p.height, width=p.width,
               num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
               enable_sound=p.audio, generator=torch.Generator("cpu").manual_seed(p.seed),
               output_type="pt")
    return out.video.float().cpu()[None], out.sound
