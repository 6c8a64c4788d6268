"""What a request gets for the fields it leaves out: the server's defaults, as values and rules.

Pure values and the rules the families share; each family module (``engine.families.flux``
and the others) says which rule its full-size models follow (``Family.defaults``), and
``engine.server.model_defaults`` reads the model directory and the diffusers pipeline's own
call defaults (``engine.pipeline_defaults``) and applies it. Test-sized models (a DiT
narrower than 1024) get ``TINY`` (video: ``TINY_VIDEO_FRAMES`` frames) whatever their family.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelDefaults:
    width: int
    height: int
    steps: int
    output: str = "image"  # "image" | "video"
    frames: int = 1
    fps: int = 16
    guidance: float = 3.5  # Flux-dev's distilled guidance; Wan's CFG scale
    true_cfg: float = 1.0  # Flux and Qwen-Image: CFG scale with a negative prompt
    # A video model whose one-frame video is a still image (``Family.still_images``).
    still_images: bool = False

    @property
    def makes_images(self) -> bool:
        """Whether the model makes images: an image model, or a video model's one frame."""
        return self.output == "image" or self.still_images


TINY = ModelDefaults(64, 64, 4)
TINY_STEPS = 4
TINY_VIDEO_FRAMES = 9
FULL_SIDE = 1024
MIN_SAMPLE_SIDE = 256  # a VAE sample_size below this is a test value, not an image size
VIDEO_FPS = 16  # the Wan 2.1 and Wan 2.2 A14B models' native frame rate
RESIDUAL_VAE_FPS = 24  # Wan 2.2 TI2V-5B's, the one model with Wan 2.2's residual 16x VAE


def image_side(vae: Mapping[str, Any]) -> int:
    """The VAE's ``sample_size`` when it is a real image size (Flux.1: 1024), else 1024."""
    sample = vae.get("sample_size")
    return sample if isinstance(sample, int) and sample >= MIN_SAMPLE_SIDE else FULL_SIDE


def square_image(dit: Mapping[str, Any], vae: Mapping[str, Any],
                 call: Mapping[str, Any]) -> ModelDefaults:
    """An image family's usual rule: a square of the VAE's size, the pipeline's step count."""
    side = image_side(vae)
    return ModelDefaults(side, side, int(call["num_inference_steps"]))


def pipeline_video(dit: Mapping[str, Any], vae: Mapping[str, Any],
                   call: Mapping[str, Any]) -> ModelDefaults:
    """A video family's usual rule: the pipeline's own size, frame count and step count, at
    the model's frame rate (read off its VAE: Wan 2.2's residual VAE comes with TI2V-5B, which
    generates 24 fps; the Wan 2.1 VAE's models, Wan 2.2 A14B included, 16)."""
    fps = RESIDUAL_VAE_FPS if vae.get("is_residual") is True else VIDEO_FPS
    return ModelDefaults(int(call["width"]), int(call["height"]),
                         int(call["num_inference_steps"]), output="video",
                         frames=int(call["num_frames"]), fps=fps)
