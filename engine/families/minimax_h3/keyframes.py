"""MiniMax-H3's keyframe workflow (``fl2va``): a video that starts on, ends on, or runs
between given frames.

What diffusers' ``fl2va`` blocks do before the denoise loop, for one request:

- ``anchors``: which end of the video each of the request's images holds (``images`` in
  packed order; with ``last_frame`` the final one is the last frame);
- ``on_canvas`` (``MiniMaxH3ResizeStep``): the first keyframe stretched onto the canvas, a
  follower cover-cropped onto it with the released model's rounding;
- the prompt's presentation with a label and a vision block per keyframe
  (``engine.families.minimax_h3.presentation``);
- ``encode`` (``MiniMaxH3KeyframeVaeEncoderStep``, ``encode_vae_condition``): each keyframe's
  conditioning latents, sampled under the fixed seed 42 and rounded through float16;
- ``noised_rows`` (``MiniMaxH3PrepareConditionLatentsStep``): one noise draw per keyframe off
  the request's generator, mixed in at ``t = 0.999`` and patchified - drawn before the
  generated rows' noise, as diffusers draws.

Qwen3-VL's image processor, which reads the keyframes into the prompt, comes from the
model's ``processor`` folder by transformers' ``AutoImageProcessor`` (the class diffusers'
own ``Qwen3VLProcessor`` loads there; the PIL backend where torchvision is absent). Called by
``conditioning`` and the step pipeline; the ``ref2va`` image references use the same encode
and noise recipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.pipelines.conditioning import to_pil
from ditserve.engine.request import ConditionImage

FIRST, LAST = "first", "last"
MAX_KEYFRAMES = 2  # a first and a last frame
ENCODE_SEED = 42  # diffusers' keyframe_encode_seed: the posterior's own generator
NOISE_AUG = 0.999  # diffusers' keyframe_noise_aug: the anchors' noise level, held every step
PROCESSOR = "processor"  # the model directory's folder of Qwen3-VL's processor


def anchors(images: Sequence[ConditionImage], last_frame: bool) -> tuple[str, ...]:
    """Which end of the video each image anchors, in packed order (diffusers' order: the
    first frame, then the last)."""
    count = len(images)
    if count > MAX_KEYFRAMES:
        raise InvalidRequestError("image", f"MiniMax-H3 takes at most a first and a last frame, "
                                  f"got {count} images")
    if last_frame and count == 0:
        raise InvalidRequestError("last_frame", "last_frame needs an image: the video's last "
                                  "frame")
    if count == MAX_KEYFRAMES and not last_frame:
        raise InvalidRequestError("image", "two images are a first and a last frame: mark the "
                                  "second as the last frame (last_frame)")
    if count == 0:
        return ()
    return (FIRST,) * (count - 1) + ((LAST,) if last_frame else (FIRST,))


def on_canvas(images: Sequence[ConditionImage], width: int, height: int) -> list[Any]:
    """The keyframes as PIL images on the ``width`` x ``height`` canvas: the first stretched
    (PIL's LANCZOS resize), a follower scaled to cover it and centre-cropped, rounding as the
    released model does (diffusers keeps that arithmetic, not its image processor's crop)."""
    from PIL import Image

    placed = []
    for index, image in enumerate(images):
        pil = to_pil(image)
        if pil.size == (width, height):
            placed.append(pil)
        elif index == 0:
            placed.append(pil.resize((width, height), Image.Resampling.LANCZOS))
        else:
            scale = max(width / pil.size[0], height / pil.size[1])
            cover = (max(width, round(pil.size[0] * scale)),
                     max(height, round(pil.size[1] * scale)))
            left, top = max(0, (cover[0] - width) // 2), max(0, (cover[1] - height) // 2)
            resized = pil.resize(cover, Image.Resampling.LANCZOS)
            placed.append(resized.crop((left, top, left + width, top + height)))
    return placed


def load_image_processor(model_dir: Path) -> Any:
    """Qwen3-VL's image processor from the model's ``processor`` folder, or None where the
    directory has none (a keyframe request is then refused)."""
    from transformers import AutoImageProcessor

    folder = Path(model_dir) / PROCESSOR
    if not (folder / "preprocessor_config.json").is_file():
        return None
    return AutoImageProcessor.from_pretrained(str(folder))


@torch.inference_mode()
def encode(vae: Any, keyframes: Sequence[Any], *, device: torch.device,
           pixel_mean: Sequence[float], pixel_std: Sequence[float]) -> list[torch.Tensor]:
    """Each keyframe's normalized conditioning latents, (1, C, 1, h, w) float32 on the CPU:
    diffusers' own ``encode_vae_condition`` of its uint8 pixels (a single frame: the VAE's
    spatial encoder alone)."""
    import numpy as np
    from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

    out = []
    for image in keyframes:
        # (H, W, 3) uint8 -> (1, 3, 1, H, W), as the keyframe encoder step lays it out.
        pixels = torch.from_numpy(np.array(image)).to(device).permute(2, 0, 1)[None, :, None]
        out.append(encode_vae_condition(vae, pixels, tuple(pixel_mean), tuple(pixel_std),
                                        ENCODE_SEED))
    return out


def noised_rows(scheduler: Any, conditions: Sequence[torch.Tensor], generator: torch.Generator,
                patch: tuple[int, int, int]) -> torch.Tensor:
    """(K, C * patch) float32 rows of the keyframes noised to ``NOISE_AUG``: one CPU draw per
    keyframe off ``generator`` in packed order, before the generated rows' draws."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    rows = []
    for condition in conditions:
        noise = torch.randn(condition.shape, generator=generator, dtype=torch.float32)
        noised = scheduler.scale_noise(condition, NOISE_AUG, noise)
        rows.append(patchify_video_latents(noised, patch))
    return torch.cat(rows)
