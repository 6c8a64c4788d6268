"""What a request gets when it names no size, step count or guidance: the server's defaults.

Pure values and the rules the families share; each family module (``engine.families.flux``
and the others) says which rule its full-size models follow (``Family.defaults``), and
``engine.server.model_defaults`` reads the model directory and applies it. Test-sized models
(a DiT narrower than 1024) get ``TINY`` / ``TINY_VIDEO`` whatever their family.
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
    guidance: float = 3.5  # Flux-dev's distilled guidance; Wan's CFG scale for video


TINY = ModelDefaults(64, 64, 4)
TINY_VIDEO = ModelDefaults(64, 64, 4, output="video", frames=9, fps=16, guidance=5.0)
FULL_SIDE = 1024
FULL_STEPS = 28
MIN_SAMPLE_SIDE = 256  # a VAE sample_size below this is a test value, not an image size


def image_side(vae: Mapping[str, Any]) -> int:
    """The VAE's ``sample_size`` when it is a real image size (Flux.1: 1024), else 1024."""
    sample = vae.get("sample_size")
    return sample if isinstance(sample, int) and sample >= MIN_SAMPLE_SIDE else FULL_SIDE


def square_image(dit: Mapping[str, Any], vae: Mapping[str, Any]) -> ModelDefaults:
    """An image family's usual rule: a square of the VAE's size, 28 steps."""
    side = image_side(vae)
    return ModelDefaults(side, side, FULL_STEPS)
