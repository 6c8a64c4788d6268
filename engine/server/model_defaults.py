"""The size and step count a request gets when it names neither, read off the model directory.

Called once by ServerState.build, before the model loads (the default size is also the
``--compile`` warm-up size). Reads three small JSON files, nothing else:

- a DiT narrower than 1024 (``attention_head_dim * num_attention_heads`` of
  ``transformer/config.json``) is a test-sized model, like ``ditserve model init-tiny``: 64x64
  and 4 steps (a video family: 9 frames), so a request without a size costs milliseconds;
- otherwise the family's own rule (``Family.defaults``, in its module under
  ``engine.families``) reads the DiT's and the VAE's configs: Flux a square of the VAE's
  ``sample_size`` (1024) and 28 steps, 4 for a timestep-distilled model (no guidance
  embedding: schnell); Wan its pipeline's defaults, 832x480, 81 frames (5 s at 16 fps), 50
  steps, guidance 5.0. A model of no known family gets the image rule (1024, 28 steps).

``output`` says what the replica makes (``"image"`` or ``"video"``, from the family registry):
a video replica serves /v1/videos, an image replica /v1/images/generations.

``--default-size`` / ``--default-steps`` override both.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ditserve.engine.families import family_of_pipeline
from ditserve.engine.families.defaults import TINY, TINY_VIDEO, ModelDefaults, square_image

__all__ = ["ModelDefaults", "model_defaults"]

log = logging.getLogger(__name__)

TEST_MODEL_WIDTH = 1024  # narrower DiTs are test models (the tiny one is 32 wide)


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
    vae = _json(root / "vae" / "config.json")
    defaults = (family.defaults if family is not None else square_image)(dit, vae)
    log.debug("defaults of %s: %dx%d, %d steps", root, defaults.width, defaults.height,
              defaults.steps)
    return defaults
