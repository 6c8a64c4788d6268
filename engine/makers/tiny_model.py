"""The embedded default model: a tiny, random-weight Flux pipeline in diffusers format.

Used by `ditserve demo`, `ditserve serve` without `--model`, the tests and CI. Everything is
built locally from a fixed seed (tokenizers from an in-code vocabulary), so nothing is ever
downloaded. ``init_random`` builds the same layout at real Flux size for benchmarks.
``init_tiny(path, family=...)`` writes every model variant's tiny model (Flux, Qwen-Image,
Wan 2.1, Wan 2.2 with two experts, Wan 2.2 TI2V) the same way, each built by its family's
builder module (``model_builders.build_tiny``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TINY_SEED = 0
# The released Flux.1 T5 tokenizer's model_max_length (and the Flux pipeline's default
# max_sequence_length): a tiny model encodes prompts as a default diffusers call does.
TINY_MAX_SEQUENCE_LENGTH = 512
_COMPLETE_MARKER = ".ditserve-tiny-complete"


def default_tiny_dir() -> Path:
    """Where `demo` and `serve` keep the embedded model: $DITSERVE_HOME or ~/.cache/ditserve."""
    home = os.environ.get("DITSERVE_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ditserve"
    )
    return Path(home) / "tiny-flux"


def init_tiny(
    path: str | os.PathLike[str], *, family: str = "flux", seed: int = TINY_SEED
) -> Path:
    """Write a tiny pipeline of ``family`` to ``path`` (about 1 MB). Idempotent once complete.

    Safe when several processes ask at once (the demo, a server and its workers): one builds
    into a temporary sibling under a file lock and renames it into place.
    """
    from ditserve.engine.families import MODEL_VARIANTS

    if family not in MODEL_VARIANTS:
        from ditserve.engine.errors import ConfigError

        raise ConfigError(f"family must be one of {', '.join(MODEL_VARIANTS)}, got {family!r}")
    import shutil
    import tempfile

    from filelock import FileLock

    target = Path(path)
    if (target / _COMPLETE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / _COMPLETE_MARKER).exists():
            return target
        from ditserve.engine.makers.builders import build_tiny

        pipe = build_tiny(family, seed)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            pipe.save_pretrained(str(staging))  # a modular pipeline takes a str only
            (staging / _COMPLETE_MARKER).write_text(
                json.dumps({"family": family, "seed": seed, "random_weights": True}))
            if target.exists():  # an incomplete leftover from an interrupted older version
                shutil.rmtree(target)
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def ensure_tiny(path: str | os.PathLike[str] | None = None) -> Path:
    """The embedded model's directory, created on first use."""
    return init_tiny(path or default_tiny_dir())
