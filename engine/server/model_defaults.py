"""The size and step count a request gets when it names neither, read off the model directory.

Called once by ServerState.build, before the model loads (the default size is also the
``--compile`` warm-up size). Reads two small JSON files, nothing else:

- a DiT narrower than 1024 (``attention_head_dim * num_attention_heads`` of
  ``transformer/config.json``) is a test-sized model, like ``ditserve model init-tiny``: 64x64
  and 4 steps, so a request without a size costs milliseconds, not minutes;
- otherwise the VAE's ``sample_size`` when it is a real image size (>= 256; Flux.1: 1024),
  else 1024, square; 4 steps for a timestep-distilled Flux (no guidance embedding: schnell),
  else 28 (Flux.1-dev; diffusers' FluxPipeline default);
- a video family (Wan) gets diffusers' WanPipeline defaults: 832x480, 81 frames (5 s at its
  native 16 fps), 50 steps, guidance 5.0; its test-sized models 64x64, 9 frames, 4 steps.

``output`` says what the replica makes (``"image"`` or ``"video"``, from the family registry):
a video replica serves /v1/videos, an image replica /v1/images/generations.

``--default-size`` / ``--default-steps`` override both. A family whose recommended values
differ can be given its own rule here (or by the family registry once it declares them).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditserve.engine.families import family_of_pipeline

log = logging.getLogger(__name__)

TEST_MODEL_WIDTH = 1024  # narrower DiTs are test models (the tiny one is 32 wide)


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
FULL_SIDE = 1024
FULL_STEPS = 28
DISTILLED_STEPS = 4
WAN = ModelDefaults(832, 480, 50, output="video", frames=81, fps=16, guidance=5.0)
TINY_VIDEO = ModelDefaults(64, 64, 4, output="video", frames=9, fps=16, guidance=5.0)


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def model_defaults(model_dir: str | Path | None) -> ModelDefaults:
    """Defaults for the model in ``model_dir``; None is the embedded tiny model."""
    if model_dir is None:
        return TINY
    root = Path(model_dir)
    dit = _json(root / "transformer" / "config.json")
    pipeline = _json(root / "model_index.json").get("_class_name")
    family = family_of_pipeline(pipeline)
    video = family is not None and family.video
    heads, head_dim = dit.get("num_attention_heads"), dit.get("attention_head_dim")
    if isinstance(heads, int) and isinstance(head_dim, int) and heads * head_dim < TEST_MODEL_WIDTH:
        return TINY_VIDEO if video else TINY
    if video:
        return WAN
    sample = _json(root / "vae" / "config.json").get("sample_size")
    side = sample if isinstance(sample, int) and sample >= 256 else FULL_SIDE
    distilled = pipeline == "FluxPipeline" and dit.get("guidance_embeds") is False
    defaults = ModelDefaults(side, side, DISTILLED_STEPS if distilled else FULL_STEPS)
    log.debug("defaults of %s: %dx%d, %d steps", root, defaults.width, defaults.height,
              defaults.steps)
    return defaults
