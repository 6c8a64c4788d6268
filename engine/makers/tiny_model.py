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
    wanted = {"family": family, "seed": seed, "random_weights": True}
    if _holds_tiny(target, wanted):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if _holds_tiny(target, wanted):
            return target
        refuse_foreign_directory(target, "a tiny model")
        from ditserve.engine.makers.builders import build_tiny

        pipe = build_tiny(family, seed)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            pipe.save_pretrained(str(staging))  # a modular pipeline takes a str only
            (staging / _COMPLETE_MARKER).write_text(json.dumps(wanted))
            if target.exists():  # empty (refuse_foreign_directory said so)
                target.rmdir()
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def ensure_tiny(path: str | os.PathLike[str] | None = None) -> Path:
    """The embedded model's directory, created on first use."""
    return init_tiny(path or default_tiny_dir())


def _holds_tiny(target: Path, wanted: dict[str, object]) -> bool:
    """Whether ``target`` already holds the tiny model asked for; another one is refused
    (writing over it would leave the old model under a message naming the new one)."""
    marker = target / _COMPLETE_MARKER
    if not marker.exists():
        return False
    found = json.loads(marker.read_text())
    if found != wanted:
        from ditserve.engine.errors import ConfigError

        raise ConfigError(f"{str(target)!r} already holds a different tiny model ({found}); "
                          "choose another directory")
    return True


def refuse_foreign_directory(target: Path, what: str) -> None:
    """Refuse to write ``what`` into a directory that already holds anything: it is the
    user's (a downloaded model, a home directory), never ours to replace."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        from ditserve.engine.errors import ConfigError

        kind = "a directory that is not empty" if target.is_dir() else "a file"
        raise ConfigError(f"{str(target)!r} is {kind} and holds no model ditserve wrote; "
                          f"{what} is written only to a new or empty directory: choose another")
