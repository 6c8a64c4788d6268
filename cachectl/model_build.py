"""Building entries from a local model directory with a loader the caller passes in.

Owns the bridge from a model directory to the store: the recipe (stat fingerprint of the
DiT's source files, dtype, loader name and implementation digest, placement), the model
digest (content hash of those files) and the build function (the loader's final tensors).

A request may name a DiT checkpoint file (``checkpoint``: single-file, GGUF or FP8, issue 49)
served with ``model_dir`` as its base model: then the sources are the file and the base DiT's
config (the file's tensors, the config its structure), the loader's checkpoint function builds
the tensors in the form the engine runs them (GGUF blocks and FP8 bytes as stored), and the
entry's metadata records each layer's form so an engine can build the DiT around the mapped
bytes without reading the file.

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
    sha256_json,
    source_digest,
    source_fingerprint,
)
from ditserve.cachectl.store import CacheStore

SourceFilesFn = Callable[[Path, str], Sequence[Path]]  # (model_dir, component)
LoadFn = Callable[[Path, str, str], dict[str, Any]]  # (model_dir, dtype, component)
# (checkpoint file, base model_dir, dtype, component) -> (tensors, entry metadata)
CheckpointLoadFn = Callable[[Path, Path, str, str], tuple[dict[str, Any], dict[str, str]]]


@dataclass(frozen=True)
class CheckpointLoader:
    """What the cache needs to build a checkpoint file's entry: the function's identity
    (name, version: declared version + source digest of the module that loads files), the
    base model's files that shape the DiT (``base_files(model_dir, component)``: its config)
    and ``load``, the DiT's final runtime tensors with the entry metadata to record."""

    name: str
    version: str
    base_files: SourceFilesFn = field(compare=False)
    load: CheckpointLoadFn = field(compare=False)


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
    # None: this loader builds from diffusers directories only.
    checkpoint: CheckpointLoader | None = field(default=None, compare=False)

    def version_for(self, model_dir: Path) -> str:
        """The identity's loader version for ``model_dir`` (its family's rules included)."""
        family = self.family_version(model_dir)
        return f"{self.version}/{family}" if family else self.version


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _source_digest(module: ModuleType) -> str:
    """16 hex digits of the module's source (empty where it cannot be read): any edit of a
    loader re-keys its entries."""
    try:
        source = inspect.getsource(module).encode()
    except (OSError, TypeError):
        source = b""
    return hashlib.sha256(source).hexdigest()[:16]


def _describe_checkpoint(module: ModuleType) -> CheckpointLoader:
    """A CheckpointLoader over a module with the engine's checkpoint-entry shape:
    ``CHECKPOINT_LOADER_VERSION``, ``load_checkpoint_state_dict(file, base_dir, dtype=,
    component=)`` -> (tensors, metadata) and ``checkpoint_base_files(base_dir, component)``."""
    try:
        declared = module.CHECKPOINT_LOADER_VERSION
        load_fn, base_fn = module.load_checkpoint_state_dict, module.checkpoint_base_files
    except AttributeError as e:
        raise BuildError(f"{module.__name__} is not a checkpoint loader: {e}") from e
    return CheckpointLoader(
        name=f"{module.__name__}.load_checkpoint_state_dict",
        version=f"{declared}+{_source_digest(module)}",
        base_files=lambda d, component: base_fn(d, component),
        load=lambda f, d, dtype, component: load_fn(f, d, dtype=dtype, component=component),
    )


def describe_loader(module: ModuleType, checkpoint: ModuleType | None = None) -> ModelLoader:
    """A ModelLoader over a loader module with the engine loader's shape: ``LOADER_VERSION``,
    ``dit_source_files(dir, component)``, ``load_dit_state_dict(dir, dtype=, component=)`` and
    optionally ``family_loader_version(dir)`` and ``dit_components(dir)``; ``checkpoint``: the
    module that builds checkpoint files' entries (``_describe_checkpoint``), if any."""
    try:
        declared = module.LOADER_VERSION
        files_fn, load_fn = module.dit_source_files, module.load_dit_state_dict
    except AttributeError as e:
        raise BuildError(f"{module.__name__} is not a model loader: {e}") from e
    family_fn = getattr(module, "family_loader_version", None)
    components_fn = getattr(module, "dit_components", None)
    return ModelLoader(
        name=f"{module.__name__}.load_dit_state_dict",
        version=f"{declared}+{_source_digest(module)}",
        source_files=lambda d, component: files_fn(d, component),
        load=lambda d, dtype, component: dict(load_fn(d, dtype=dtype, component=component)),
        family_version=(lambda d: str(family_fn(d))) if family_fn is not None else _no_family,
        inputs=(("diffusers", _version("diffusers")),),
        components=((lambda d: tuple(components_fn(d))) if components_fn is not None
                    else _only_transformer),
        checkpoint=None if checkpoint is None else _describe_checkpoint(checkpoint),
    )


def require_model_dir(model_dir: Path) -> None:
    """Refuse a ``--model``/``--base-model`` directory that is not there, before anything reads
    it (the dtype default included), in words that fit `cachectl`."""
    if not model_dir.is_dir():
        raise BuildError(f"model directory {str(model_dir)!r} does not exist; pass the "
                         "local diffusers directory (the one holding model_index.json)")


@dataclass(frozen=True)
class ModelRequest:
    """What to build: a local model directory, the runtime dtype, an optional revision label,
    which DiT (``component``: Wan 2.2's second expert is ``transformer_2``), and optionally a
    DiT checkpoint file served instead of the directory's DiT (the directory is its base)."""

    model_dir: Path
    dtype: str = "bfloat16"
    revision: str | None = None
    placement: Placement = Placement()
    component: str = "transformer"
    checkpoint: Path | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise CacheError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.model_dir.is_file() and self.checkpoint is None:
            raise BuildError(f"{str(self.model_dir)!r} is a checkpoint file: pass it with "
                             "--base-model DIR, a diffusers directory of the same family (its "
                             "config and other components), as `ditserve serve` takes it")
        require_model_dir(self.model_dir)
        if self.checkpoint is not None and not self.checkpoint.is_file():
            raise BuildError(f"checkpoint file {str(self.checkpoint)!r} does not exist")
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
    # Set by ``build`` for a checkpoint file: each layer's form (see the module docstring).
    metadata: dict[str, str] = field(default_factory=dict, compare=False)

    def model_digest(self) -> str:
        base = source_digest(list(self.source_files), self.request.model_dir)
        checkpoint = self.request.checkpoint
        if checkpoint is None:
            return base
        # The file by its name alone (not its directory): pods and the node see other paths.
        return sha256_json({"base": base,
                            "checkpoint": source_digest([checkpoint], checkpoint.parent)})

    def build(self) -> dict[str, Any]:
        request = self.request
        source = request.model_dir if request.checkpoint is None else request.checkpoint
        try:
            if request.checkpoint is None:
                return self.loader.load(request.model_dir, request.dtype, request.component)
            assert self.loader.checkpoint is not None  # plan_model refused it otherwise
            tensors, metadata = self.loader.checkpoint.load(
                request.checkpoint, request.model_dir, request.dtype, request.component)
            self.metadata.update(metadata)
            return tensors
        except CacheError:
            raise
        except Exception as e:  # the loader's own errors say what is wrong with the model
            raise BuildError(f"loading {str(source)!r} failed: {e}") from e


def plan_model(request: ModelRequest, loader: ModelLoader) -> ModelPlan:
    """The recipe of a model directory (or checkpoint file): stat calls only, nothing loaded
    or hashed."""
    if request.checkpoint is not None:
        return _plan_checkpoint(request, loader)
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


def _plan_checkpoint(request: ModelRequest, loader: ModelLoader) -> ModelPlan:
    checkpoint = request.checkpoint
    assert checkpoint is not None
    if loader.checkpoint is None:
        raise BuildError(f"the loader {loader.name} builds entries from diffusers directories "
                         f"only, not from the checkpoint file {str(checkpoint)!r}")
    try:
        files = tuple(loader.checkpoint.base_files(request.model_dir, request.component))
    except Exception as e:
        raise BuildError(f"{str(request.model_dir)!r} is not a usable base model directory: "
                         f"{e}") from e
    fingerprint = sha256_json({
        "base": source_fingerprint(list(files), request.model_dir),
        "checkpoint": source_fingerprint([checkpoint], checkpoint.parent)})
    recipe = recipe_for(
        source_fingerprint=fingerprint, dtype=request.dtype, loader=loader.checkpoint.name,
        loader_version=f"{loader.checkpoint.version}/{loader.version_for(request.model_dir)}",
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

    # plan.metadata is filled by build(), which the store calls before it writes the entry.
    entry = store.ensure_recipe(plan.recipe, model_digest=digest, build_fn=build,
                                metadata=plan.metadata, on_wait=on_wait,
                                on_progress=on_progress)
    if entry.built:
        # Stamp now, while we can write: engines join on a read-only mount and would
        # otherwise re-hash the whole entry at every start.
        phase("verifying and stamping")
        report = store.stamp(entry.key)
        if not report.ok:
            entry.close()
            raise EntryCorruptError(entry.key, report.problems)
    return entry
