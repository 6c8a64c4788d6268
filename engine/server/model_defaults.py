"""What a request gets for the fields it leaves out, read off the model directory and its
diffusers pipeline: the same defaults as a default diffusers call.

Called once by ServerState.build and by ``ditserve generate``, before the model loads (the
default size is also the ``--compile`` warm-up size). Reads three small JSON files and the
pipeline class's ``__call__`` defaults (``pipeline_defaults.call_defaults``, from the source
of the family's ``pipeline_module``: diffusers is not imported here), nothing else:

- guidance and true CFG are the pipeline's own defaults: Flux ``guidance_scale`` 3.5 and
  ``true_cfg_scale`` 1.0; Qwen-Image ``true_cfg_scale`` 4.0 (true CFG runs once a
  ``negative_prompt`` is given, the empty one included); Wan ``guidance_scale`` 5.0 (CFG
  against ``negative_prompt``, or the empty prompt);
- a DiT narrower than 1024 (``attention_head_dim * num_attention_heads`` of
  ``transformer/config.json``, or its ``dim`` or ``hidden_size``: ``families.base.dit_width``)
  is a test-sized model, like ``ditserve model init-tiny``: 64x64 and 4 steps (video: 9
  frames, or the family's shortest clip, at the family's own frame rate), so a request without a size costs milliseconds, not minutes;
- otherwise the family's own rule (``Family.defaults``, in its module under
  ``engine.families``) gives size, steps and frames: an image family a square of the VAE's
  ``sample_size`` when it is a real image size (>= 256; Flux.1: 1024), else 1024, and the
  pipeline's ``num_inference_steps`` (Flux.1-dev 28, Qwen-Image 50; 4 for a
  timestep-distilled Flux: schnell, no guidance embedding); a video family (Wan) the
  pipeline's own 832x480, 81 frames (5 s at its native 16 fps), 50 steps.

``output`` says what the replica makes (``"image"`` or ``"video"``, from the family registry):
a video replica serves /v1/videos, an image replica /v1/images/generations, and a video
replica whose family makes still images (``still_images``: Cosmos3's one frame) both.

A family whose checkpoints run one pipeline class differently (Z-Image-Turbo and Base) says
what a checkpoint's scheduler config changes of the call defaults (``Family.call_overrides``).

``--default-size`` / ``--default-steps`` override size and steps.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ditserve.engine.families import FLUX, family_of_pipeline
from ditserve.engine.families.base import dit_width, index_file
from ditserve.engine.families.defaults import TINY, TINY_VIDEO_FRAMES, ModelDefaults
from ditserve.engine.pipeline_defaults import call_defaults

__all__ = ["ModelDefaults", "model_defaults"]

log = logging.getLogger(__name__)

TEST_MODEL_WIDTH = 1024  # narrower DiTs are test models (the tiny one is 32 wide)
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
    found = None if root is None else index_file(root)
    index = {} if found is None else _json(found)
    family = FLUX if root is None else family_of_pipeline(index.get("_class_name"))
    if family is None:  # not a supported model: the loader refuses it with the reason
        return TINY
    call: Mapping[str, Any] = call_defaults(family.pipeline_class, family.pipeline_module)
    if root is not None and family.call_overrides is not None:
        # The checkpoint's own way to run the shared pipeline class (Z-Image-Turbo).
        scheduler = _json(root / "scheduler" / "scheduler_config.json")
        call = {**call, **family.call_overrides(scheduler)}
    guidance = _number(call.get("guidance_scale"), IGNORED_GUIDANCE)
    true_cfg = _number(call.get("true_cfg_scale"), 1.0)
    if root is None:
        return replace(TINY, guidance=guidance, true_cfg=true_cfg)
    dit = _json(root / "transformer" / "config.json")
    width = dit_width(dit)
    tiny = width is not None and width < TEST_MODEL_WIDTH
    if tiny and not family.video:
        size = TINY
    else:
        size = family.defaults(dit, _json(root / "vae" / "config.json"), call)
    if tiny and family.video:
        frames = max(TINY_VIDEO_FRAMES, family.min_frames)  # MiniMax-H3: 5 s at least
        # At the family's own frame rate: the one its sound track is made for (24 fps:
        # Cosmos3, MiniMax-H3), and the one ``seconds`` counts frames at.
        size = replace(TINY, output="video", frames=frames, fps=size.fps)
    defaults = replace(size, guidance=guidance, true_cfg=true_cfg,
                       still_images=family.still_images)
    log.debug("defaults of %s: %s", root, defaults)
    return defaults
