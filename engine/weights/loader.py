"""Loads a model directory's components by its family; never downloads.

The family comes from ``model_index.json``'s ``_class_name`` (``engine.families``); the
directory must hold that family's components, and its DiTs (``transformer``, plus Wan 2.2's
``transformer_2`` expert where present) must be of the family's DiT class. Components load
through the family's own diffusers pipeline class, so every text encoder, tokenizer, VAE and
scheduler is built exactly as diffusers builds it; DiTs prepared elsewhere (offload's mapped
or cached backings) are passed in and used as they are.

Called by the model runner (whole pipelines), by `cachectl build` (one DiT's final tensors,
``load_dit_state_dict``) and by benchmarks; anything else fails with a message naming what
was found.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ditserve.engine.errors import ModelLoadError
from ditserve.engine.families import (
    FLUX,
    Family,
    family_of_pipeline,
    supported_pipelines,
)
from ditserve.engine.families.base import dit_heads, index_file

if TYPE_CHECKING:
    import torch

# Bump when the tensors produced for the same inputs change (the cache keys on it, together
# with the family's own ``loader_version``: ``loader_version(model_dir)``).
LOADER_VERSION = "loader-2"
DIT_COMPONENT = "transformer"  # the first (or only) DiT of every family


@dataclass
class LoadedComponents:
    """The pipeline's parts, on CPU, in the requested dtype (tokenizers and scheduler aside).

    config: the pipeline's own settings from model_index.json (Wan: ``boundary_ratio``,
    ``expand_timesteps``); dit_components: the DiTs present, in the order a step uses them;
    pipeline: the diffusers pipeline object the modules came from (families read its layout
    constants, such as Qwen-Image's prompt template, instead of copying them).
    """

    pipeline_class: str
    model_dir: Path
    modules: dict[str, Any]
    family: Family = FLUX
    config: dict[str, Any] = field(default_factory=dict)
    dit_components: tuple[str, ...] = (DIT_COMPONENT,)
    pipeline: Any = None


def read_model_index(model_dir: str | Path) -> tuple[str, dict[str, Any]]:
    """Validate the directory layout; return (pipeline class, model_index)."""
    family, index = _family_and_index(model_dir)
    return family.pipeline_class, index


def model_family(model_dir: str | Path) -> Family:
    """The family of a valid model directory."""
    return _family_and_index(model_dir)[0]


def _family_and_index(model_dir: str | Path) -> tuple[Family, dict[str, Any]]:
    root = Path(model_dir)
    if root.is_file():
        raise ModelLoadError(
            f"{str(root)!r} is a file, not a diffusers directory: a DiT checkpoint file goes "
            "with --model FILE --base-model DIR (ditserve serve and cachectl build alike; "
            "docs/formats.md)"
        )
    if not root.is_dir():
        raise ModelLoadError(
            f"model directory {str(root)!r} does not exist; pass a local diffusers directory "
            "(--model DIR, or --base-model DIR beside a checkpoint file; ditserve never "
            "downloads weights), or omit --model to use the tiny model"
        )
    found_index = index_file(root)
    if found_index is None:
        raise ModelLoadError(
            f"{str(root)!r} has no model_index.json (nor a modular pipeline's "
            "modular_model_index.json); it is not a diffusers pipeline directory"
        )
    try:
        index = json.loads(found_index.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{found_index} is not valid JSON: {e}") from e
    cls = index.get("_class_name")
    family = family_of_pipeline(cls)
    if family is None:
        raise ModelLoadError(
            f"{str(root)!r} holds a {cls!r} pipeline; supported: {', '.join(supported_pipelines())}"
        )
    missing = [
        name for name in (*family.dit_components, *family.components)
        if not _present(index, root, name)
    ]
    if missing:
        raise ModelLoadError(
            f"{str(root)!r} is incomplete: missing component(s) {', '.join(missing)}"
        )
    for name in dit_components_of(family, index, root):
        entry = index[name]  # [library, class], or a modular index's [library, class, spec]
        found = entry[1] if isinstance(entry, list) and len(entry) in (2, 3) else None
        if found != family.dit_class:
            raise ModelLoadError(
                f"{str(root)!r}: component {name} is a {found!r}; a {family.pipeline_class} "
                f"serves {family.dit_class} DiTs"
            )
    return family, index


def _present(index: Mapping[str, Any], root: Path, name: str) -> bool:
    entry = index.get(name)
    # diffusers writes [null, null] for an optional component the pipeline was saved without.
    return isinstance(entry, list) and entry[0] is not None and (root / name).is_dir()


def dit_components_of(family: Family, index: Mapping[str, Any], root: Path) -> tuple[str, ...]:
    """The family's DiTs this directory holds and uses, in call order (experts after the
    first; an expert without its switch is never run, as in diffusers, so not loaded)."""
    if family.expert_switch is None or index.get(family.expert_switch) is None:
        return family.dit_components
    experts = tuple(n for n in family.expert_components if _present(index, root, n))
    return (*family.dit_components, *experts)


def dit_components(model_dir: str | Path) -> tuple[str, ...]:
    """The DiT components of a model directory (Wan 2.2: transformer, transformer_2)."""
    family, index = _family_and_index(model_dir)
    return dit_components_of(family, index, Path(model_dir))


def dit_attention_heads(model_dir: str | Path) -> dict[str, int]:
    """Each DiT's attention head count, from its ``config.json`` (nothing is loaded): what
    sequence parallelism splits over its ranks (``config.sequence_parallel_problems``)."""
    heads = {}
    for component in dit_components(model_dir):
        path = Path(model_dir) / component / "config.json"
        try:
            count = dit_heads(json.loads(path.read_text()))
            if count is None:
                raise KeyError("num_attention_heads")
            heads[component] = count
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"cannot read the attention head count of {str(path)!r}: "
                                 f"{e!r}") from e
    return heads


def family_loader_version(model_dir: str | Path) -> str:
    """The version of this directory's family's loading rules (``Family.loader_version``)."""
    return model_family(model_dir).loader_version


def loader_version(model_dir: str | Path) -> str:
    """The loader version of this directory's family (part of a cache entry's identity)."""
    return f"{LOADER_VERSION}/{family_loader_version(model_dir)}"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name (``float32``, ``bfloat16``, ``float16``)."""
    import torch

    from ditserve.engine.config import DTYPES
    from ditserve.engine.errors import ConfigError

    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def dit_class(model_dir: str | Path | None = None, component: str = DIT_COMPONENT) -> Any:
    """The DiT's model class (the offload loader builds it on the meta device).

    Without ``model_dir``: Flux's, the embedded tiny model's family.
    """
    import diffusers

    family = FLUX if model_dir is None else model_family(model_dir)
    if model_dir is not None and component not in dit_components(model_dir):
        raise ModelLoadError(f"{str(model_dir)!r} has no DiT component {component!r}")
    return getattr(diffusers, family.dit_class)


def import_pipeline_class(family: Family) -> Any:
    """The family's diffusers pipeline class, imported: with it diffusers, the model's DiT,
    VAE and text-encoder classes and transformers (several seconds: the engine's start phase
    ``imports``; nothing the server builds before imports them)."""
    import diffusers

    return getattr(diffusers, family.pipeline_class)


def keeps_float32(model_cls: Any, tensor_name: str) -> bool:
    """Whether diffusers loads this DiT tensor in float32 whatever the dtype asked for (the
    class's ``_keep_in_fp32_modules``, e.g. Wan's norms and modulation tables), matched the
    way diffusers matches it: a module name among the name's dotted parts."""
    keep = getattr(model_cls, "_keep_in_fp32_modules", None) or ()
    parts = tensor_name.split(".")
    return any(module in parts for module in keep)


def load_dit(model_dir: str | Path, *, dtype: str, component: str = DIT_COMPONENT) -> Any:
    """One DiT alone, ordinarily loaded onto the CPU (eval, no grad)."""
    cls = dit_class(model_dir, component)
    try:
        model = cls.from_pretrained(Path(model_dir), subfolder=component,
                                    dtype=torch_dtype(dtype))
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(
            f"could not load the DiT {component} from {str(model_dir)!r}: {e}") from e
    return model.eval().requires_grad_(False)


def load_components(
    model_dir: str | Path,
    *,
    dtype: str = "float32",
    transformer: Any = None,
    dits: Mapping[str, Any] | None = None,
) -> LoadedComponents:
    """Load every component of a supported pipeline onto the CPU.

    dits: already prepared DiTs by component name (the offload loader's, e.g. bound to a
    mapping), used as they are instead of loading them; ``transformer`` is the same for the
    first DiT alone.
    """
    import diffusers
    from diffusers.utils import logging as diffusers_logging

    family, index = _family_and_index(model_dir)
    root = Path(model_dir)
    given = dict(dits or {})
    if transformer is not None:
        given[DIT_COMPONENT] = transformer
    used = dit_components_of(family, index, root)
    for name in family.expert_components:
        if name not in used and _present(index, root, name):
            given[name] = None  # an expert its pipeline never runs: not loaded
    for name in family.self_loaded:
        given[name] = None  # the step pipeline reads it from the directory itself
    _quiet_transformers()
    diffusers_logging.disable_progress_bar()  # the engine reports its own progress
    pipeline_cls = getattr(diffusers, family.pipeline_class)
    try:
        if issubclass(pipeline_cls, diffusers.ModularPipeline):
            pipe = _load_modular(pipeline_cls, root, family, index, dtype=dtype, given=given)
        else:
            # Every module in the serving dtype; the given DiTs are taken as they are.
            pipe = pipeline_cls.from_pretrained(root, dtype=torch_dtype(dtype),
                                                **family.load_options, **given)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(
            f"could not load {family.pipeline_class} from {str(root)!r}: {e}") from e
    modules = {name: module for name, module in pipe.components.items() if module is not None}
    for module in modules.values():
        if hasattr(module, "requires_grad_"):
            module.eval().requires_grad_(False)
    config = {k: v for k, v in dict(pipe.config).items()
              if not k.startswith("_") and k not in pipe.components}
    return LoadedComponents(
        pipeline_class=family.pipeline_class, model_dir=root, modules=modules, family=family,
        config=config, dit_components=used, pipeline=pipe,
    )


def _load_modular(pipeline_cls: Any, root: Path, family: Family, index: Mapping[str, Any], *,
                  dtype: str, given: Mapping[str, Any]) -> Any:
    """A modular pipeline (diffusers ships MiniMax-H3 as one only): its blocks from the
    directory's index, then the family's components from the directory - the given ones
    (prepared DiTs) taken as they are, the ones given as None never loaded."""
    pipe = pipeline_cls.from_pretrained(root)
    wanted = [name for name in (*family.dit_components, *family.components)
              if name not in given and _present(index, root, name)]
    pipe.load_components(names=wanted, dtype=torch_dtype(dtype))
    ready = {name: module for name, module in given.items() if module is not None}
    if ready:
        pipe.update_components(**ready)
    return pipe


def _quiet_transformers() -> None:
    # transformers prints a per-component "Loading weights" bar; the engine reports its own progress.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def dit_source_files(model_dir: str | Path, component: str = DIT_COMPONENT) -> list[Path]:
    """The files that determine one DiT's tensors (config and weights), sorted."""
    if component not in dit_components(model_dir):
        raise ModelLoadError(f"{str(model_dir)!r} has no DiT component {component!r}")
    folder = Path(model_dir) / component
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not any(p.suffix == ".safetensors" for p in files):
        raise ModelLoadError(f"{str(folder)!r} has no .safetensors weights")
    return files


def load_dit_state_dict(
    model_dir: str | Path, *, dtype: str, component: str = DIT_COMPONENT
) -> dict[str, torch.Tensor]:
    """One DiT's final runtime tensors (parameters and persistent buffers), contiguous, on CPU."""
    model = load_dit(model_dir, dtype=dtype, component=component)
    return {name: t.detach().contiguous() for name, t in model.state_dict().items()}
