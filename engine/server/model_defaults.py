"""What a request gets for the fields it leaves out, read off the model directory and its
diffusers pipeline: the same defaults as a default diffusers call.

Called once by ServerState.build and by ``ditserve generate``, before the model loads (the
default size is also the ``--compile`` warm-up size). Reads two small JSON files and the
pipeline class's ``__call__`` signature (``pipeline_defaults.call_defaults``), nothing else:

- guidance and true CFG are the pipeline's own defaults: Flux ``guidance_scale`` 3.5 and
  ``true_cfg_scale`` 1.0; Qwen-Image ``true_cfg_scale`` 4.0 (true CFG runs once a
  ``negative_prompt`` is given, the empty one included); Wan ``guidance_scale`` 5.0 (CFG
  against ``negative_prompt``, or the empty prompt);
- a DiT narrower than 1024 (``attention_head_dim * num_attention_heads`` of
  ``transformer/config.json``) is a test-sized model, like ``ditserve model init-tiny``: 64x64
  and 4 steps (video: 9 frames), so a request without a size costs milliseconds, not minutes;
- otherwise the VAE's ``sample_size`` when it is a real image size (>= 256; Flux.1: 1024),
  else 1024, square; 4 steps for a timestep-distilled Flux (no guidance embedding: schnell),
  else the pipeline's ``num_inference_steps`` (Flux.1-dev 28, Qwen-Image 50);
- a video family (Wan) gets WanPipeline's defaults: 832x480, 81 frames (5 s at its native
  16 fps), 50 steps.

``output`` says what the replica makes (``"image"`` or ``"video"``, from the family registry):
a video replica serves /v1/videos, an image replica /v1/images/generations.

``--default-size`` / ``--default-steps`` override size and steps.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ditserve.engine.families import FLUX, family_of_pipeline
from ditserve.engine.pipeline_defaults import call_defaults

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
    guidance: float = 3.5  # Flux-dev's distilled guidance; Wan's CFG scale
    true_cfg: float = 1.0  # Flux and Qwen-Image: CFG scale with a negative prompt


TINY = ModelDefaults(64, 64, 4)
FULL_SIDE = 1024
DISTILLED_STEPS = 4
TINY_STEPS = 4
TINY_VIDEO_FRAMES = 9
IGNORED_GUIDANCE = 1.0  # a pipeline without guidance_scale (Qwen-Image's is None: unused)


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _number(value: object, fallback: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else fallback


def model_defaults(model_dir: str | Path | None) -> ModelDefaults:
    """Defaults for the model in ``model_dir``; None is the embedded tiny model (Flux)."""
    root = None if model_dir is None else Path(model_dir)
    index = {} if root is None else _json(root / "model_index.json")
    family = FLUX if root is None else family_of_pipeline(index.get("_class_name"))
    if family is None:  # not a supported model: the loader refuses it with the reason
        return TINY
    call = call_defaults(family.pipeline_class)
    guidance = _number(call.get("guidance_scale"), IGNORED_GUIDANCE)
    true_cfg = _number(call.get("true_cfg_scale"), 1.0)
    if root is None:
        return replace(TINY, guidance=guidance, true_cfg=true_cfg)
    dit = _json(root / "transformer" / "config.json")
    heads, head_dim = dit.get("num_attention_heads"), dit.get("attention_head_dim")
    tiny = isinstance(heads, int) and isinstance(head_dim, int) \
        and heads * head_dim < TEST_MODEL_WIDTH
    if family.video:
        full = ModelDefaults(int(call["width"]), int(call["height"]),
                             int(call["num_inference_steps"]), output="video",
                             frames=int(call["num_frames"]), fps=16, guidance=guidance,
                             true_cfg=true_cfg)
        return replace(full, width=64, height=64, steps=TINY_STEPS,
                       frames=TINY_VIDEO_FRAMES) if tiny else full
    if tiny:
        return replace(TINY, guidance=guidance, true_cfg=true_cfg)
    sample = _json(root / "vae" / "config.json").get("sample_size")
    side = sample if isinstance(sample, int) and sample >= 256 else FULL_SIDE
    distilled = family is FLUX and dit.get("guidance_embeds") is False
    steps = DISTILLED_STEPS if distilled else int(call["num_inference_steps"])
    defaults = ModelDefaults(side, side, steps, guidance=guidance, true_cfg=true_cfg)
    log.debug("defaults of %s: %s", root, defaults)
    return defaults
