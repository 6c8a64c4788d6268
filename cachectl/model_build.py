"""Building entries from a local model directory with a loader the caller passes in.

Owns the bridge from a model directory to the store: the recipe (stat fingerprint of the
DiT's source files, dtype, loader name and implementation digest, placement), the model
digest (content hash of those files) and the build function (the loader's final tensors).
The loader is an argument (``ModelLoader``): this module, like the whole library, never
imports the engine. Only the edges do: the CLI hands the engine's loader to ``build`` /
``ensure`` and to the daemon, and the engine describes its own loader the same way
(``describe_loader(ditserve.engine.weights.loader)``), so both compute the same recipe.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
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

SourceFilesFn = Callable[[Path, str], Sequence[Path]]  # (model_dir, component)
LoadFn = Callable[[Path, str, str], dict[str, Any]]  # (model_dir, dtype, component)


def _no_family(model_dir: Path) -> str:
    return ""


def _only_transformer(model_dir: Path) -> tuple[str, ...]:
    return ("transformer",)


@dataclass(frozen=True)
class ModelLoader:
    """What the cache needs from a loader: its identity and two functions.

    name / version: recorded in the identity (version: declared version + source digest, so
    any edit of the loader re-keys its entries); family_version(model_dir): the version of
    the model family's own loading rules, appended to ``version`` per model directory;
    source_files(model_dir, component): the files that determine one DiT's tensors;
    load(model_dir, dtype, component): that DiT's final runtime tensors {name: tensor}.
    """

    name: str
    version: str
    source_files: SourceFilesFn = field(compare=False)
    load: LoadFn = field(compare=False)
    family_version: Callable[[Path], str] = field(default=_no_family, compare=False)
    inputs: tuple[tuple[str, str], ...] = ()
    # The DiT components of a model directory (Wan 2.2: transformer and transformer_2).
    components: Callable[[Path], tuple[str, ...]] = field(default=_only_transformer,
                                                          compare=False)

    def version_for(self, model_dir: Path) -> str:
        """The identity's loader version for ``model_dir`` (its family's rules included)."""
        family = self.family_version(model_dir)
        return f"{self.version}/{family}" if family else self.version


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def describe_loader(module: ModuleType) -> ModelLoader:
    """A ModelLoader over a loader module with the engine loader's shape: ``LOADER_VERSION``,
    ``dit_source_files(dir, component)``, ``load_dit_state_dict(dir, dtype=, component=)`` and
    optionally ``family_loader_version(dir)``."""
    try:
        source = inspect.getsource(module).encode()
    except (OSError, TypeError):
        source = b""
    try:
        declared = module.LOADER_VERSION
        files_fn, load_fn = module.dit_source_files, module.load_dit_state_dict
    except AttributeError as e:
        raise BuildError(f"{module.__name__} is not a model loader: {e}") from e
    family_fn = getattr(module, "family_loader_version", None)
    components_fn = getattr(module, "dit_components", None)
    return ModelLoader(
        name=f"{module.__name__}.load_dit_state_dict",
        version=f"{declared}+{hashlib.sha256(source).hexdigest()[:16]}",
        source_files=lambda d, component: files_fn(d, component),
        load=lambda d, dtype, component: dict(load_fn(d, dtype=dtype, component=component)),
        family_version=(lambda d: str(family_fn(d))) if family_fn is not None else _no_family,
        inputs=(("diffusers", _version("diffusers")),),
        components=((lambda d: tuple(components_fn(d))) if components_fn is not None
                    else _only_transformer),
    )


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


@dataclass(frozen=True)
class ModelPlan:
    """Everything the store needs to ensure a model's entry."""

    request: ModelRequest
    loader: ModelLoader
    recipe: Recipe
    source_files: tuple[Path, ...]

    def model_digest(self) -> str:
        return source_digest(list(self.source_files), self.request.model_dir)

    def build(self) -> dict[str, Any]:
        try:
            return self.loader.load(self.request.model_dir, self.request.dtype,
                                    self.request.component)
        except CacheError:
            raise
        except Exception as e:  # the loader's own errors say what is wrong with the model
            raise BuildError(f"loading {str(self.request.model_dir)!r} failed: {e}") from e


def plan_model(request: ModelRequest, loader: ModelLoader) -> ModelPlan:
    """The recipe of a model directory: stat calls only, nothing loaded or hashed."""
    try:
        files = tuple(loader.source_files(request.model_dir, request.component))
    except Exception as e:
        raise BuildError(f"{str(request.model_dir)!r} is not a usable model directory: {e}") from e
    recipe = recipe_for(
        source_fingerprint=source_fingerprint(list(files), request.model_dir),
        dtype=request.dtype, loader=loader.name,
        loader_version=loader.version_for(request.model_dir),
        revision=request.revision, loader_inputs=dict(loader.inputs),
        components=(request.component,), placement=request.placement,
    )
    return ModelPlan(request, loader, recipe, files)


def ensure_model(store: CacheStore, request: ModelRequest, loader: ModelLoader, *,
                 on_phase: Callable[[str], None] | None = None,
                 on_wait: Callable[[float], None] | None = None,
                 on_progress: Callable[[int, int], None] | None = None) -> Entry:
    """Build-or-join the model's entry; a known recipe maps it without hashing or loading."""
    phase = on_phase or (lambda _p: None)
    plan = plan_model(request, loader)

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
