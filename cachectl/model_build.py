"""Building entries from a local diffusers model with the engine's loader.

Owns the bridge from a model directory to the store: the recipe (stat fingerprint of the
DiT's source files, dtype, loader name and implementation digest, placement), the model
digest (content hash of those files) and the build function (the engine loader's final DiT
tensors). The engine is imported lazily, here only, so ``cachectl.store`` never imports it.
Called by the CLI (``build``, ``ensure`` without a daemon) and by the daemon.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditserve.cachectl.entry import Entry
from ditserve.cachectl.errors import BuildError, CacheError, EntryCorruptError
from ditserve.cachectl.identity import (
    DTYPES,
    Placement,
    Recipe,
    recipe_for,
    source_digest,
    source_fingerprint,
)
from ditserve.cachectl.store import CacheStore

LOADER_NAME = "ditserve.engine.loader.load_dit_state_dict"


@dataclass(frozen=True)
class ModelRequest:
    """What to build: a local model directory, the runtime dtype, an optional revision label,
    and which DiT (``component``: Wan 2.2's second expert is ``transformer_2``)."""

    model_dir: Path
    dtype: str = "bfloat16"
    revision: str | None = None
    placement: Placement = Placement()
    component: str = "transformer"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise CacheError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not self.model_dir.is_dir():
            raise BuildError(f"model directory {str(self.model_dir)!r} does not exist; pass the "
                             "local diffusers directory (the one holding model_index.json)")
        if self.placement.tp_size > 1:
            raise BuildError("the engine loader produces unsharded tensors; tp_size > 1 is not "
                             "supported by `cachectl build` yet")


def _loader() -> Any:
    try:
        from ditserve.engine import loader
    except ImportError as e:  # pragma: no cover - only in a broken install
        raise BuildError(f"the engine loader is not importable: {e}") from e
    return loader


def _implementation_digest(loader: Any, model_dir: Path) -> str:
    """The loader's declared version for the model's family plus a digest of its source: any
    edit re-keys entries."""
    try:
        source = inspect.getsource(loader).encode()
    except (OSError, TypeError):
        source = b""
    return f"{loader.loader_version(model_dir)}+{hashlib.sha256(source).hexdigest()[:16]}"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@dataclass(frozen=True)
class ModelPlan:
    """Everything the store needs to ensure a model's entry."""

    request: ModelRequest
    recipe: Recipe
    source_files: tuple[Path, ...]

    def model_digest(self) -> str:
        return source_digest(list(self.source_files), self.request.model_dir)

    def build(self) -> dict[str, Any]:
        loader = _loader()
        try:
            return dict(loader.load_dit_state_dict(self.request.model_dir, dtype=self.request.dtype,
                                                   component=self.request.component))
        except Exception as e:  # the loader's own errors say what is wrong with the model
            raise BuildError(f"loading {str(self.request.model_dir)!r} failed: {e}") from e


def plan_model(request: ModelRequest) -> ModelPlan:
    """The recipe of a model directory: stat calls only, nothing loaded or hashed."""
    loader = _loader()
    try:
        files = tuple(loader.dit_source_files(request.model_dir, request.component))
    except Exception as e:
        raise BuildError(f"{str(request.model_dir)!r} is not a usable model directory: {e}") from e
    recipe = recipe_for(
        source_fingerprint=source_fingerprint(list(files), request.model_dir),
        dtype=request.dtype, loader=LOADER_NAME,
        loader_version=_implementation_digest(loader, request.model_dir),
        revision=request.revision,
        loader_inputs={"diffusers": _version("diffusers")},
        components=(request.component,), placement=request.placement,
    )
    return ModelPlan(request, recipe, files)


def ensure_model(store: CacheStore, request: ModelRequest, *,
                 on_phase: Callable[[str], None] | None = None,
                 on_wait: Callable[[float], None] | None = None,
                 on_progress: Callable[[int, int], None] | None = None) -> Entry:
    """Build-or-join the model's entry; a known recipe maps it without hashing or loading."""
    phase = on_phase or (lambda _p: None)
    plan = plan_model(request)

    def digest() -> str:
        phase("hashing model sources")
        return plan.model_digest()

    def build() -> dict[str, Any]:
        phase("loading model")
        tensors = plan.build()
        phase("writing entry")
        return tensors

    entry = store.ensure_recipe(plan.recipe, model_digest=digest, build_fn=build,
                                on_wait=on_wait, on_progress=on_progress)
    if entry.built:
        # Stamp now, while we can write: engines join on a read-only mount and would
        # otherwise re-hash the whole entry at every start.
        phase("verifying and stamping")
        report = store.stamp(entry.key)
        if not report.ok:
            entry.close()
            raise EntryCorruptError(entry.key, report.problems)
    return entry
