"""Writing a random pipeline one large component at a time (``init-random``).

A family's ``build_pipeline`` builds every large module through two makers: ``make_dit``
(``engine.makers.builders``) and ``build_released`` (``engine.makers.released``). Both hand
each module, as soon as it is built, to ``finished(name, module)``. Outside
``writing_components`` that returns the module unchanged (the bench builds DiTs in memory).
Inside it, the module is written to ``<directory>/<name>`` at once - with the arguments a
diffusers pipeline's ``save_pretrained`` would pass it - and its tensors are moved to the meta
device, freeing them before the family builds the next one. The pipeline object then holds
empty (meta) modules with their configs, so ``save_pipeline`` can write everything else
(``model_index.json``, tokenizers, schedulers, the small parts) through diffusers' own
``save_pretrained``, with the written modules' save methods stubbed out.

So the peak memory of a build is about its largest component, not the pipeline's sum (a
FLUX.2 [dev] DiT is 60 GiB in bfloat16, its Mistral encoder 45 GiB: together they do not
fit one 80 GiB GPU). Every module is still built, in the same order and from the same seeds
as a whole build, so the files are byte for byte those a whole build writes. A component is
written through a symlink in its place (``bench/whole_pipeline.py --spill-dir``) like any
other save.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditserve.engine.errors import ConfigError

MAX_SHARD_SIZE = "5GB"


@dataclass
class _Writer:
    directory: Path
    max_shard_size: str
    written: dict[str, Any] = field(default_factory=dict)  # name -> the (emptied) module
    log: list[tuple[str, str]] = field(default_factory=list)  # ("written", name), in order


_WRITER: ContextVar[_Writer | None] = ContextVar("ditserve_component_writer", default=None)


@contextmanager
def writing_components(directory: str | Path, *,
                       max_shard_size: str = MAX_SHARD_SIZE) -> Iterator[_Writer]:
    """While active, every module given to ``finished`` is written under ``directory`` and
    emptied (module docstring); the writer's ``written`` maps the names to the modules."""
    writer = _Writer(Path(directory), max_shard_size)
    token = _WRITER.set(writer)
    try:
        yield writer
    finally:
        _WRITER.reset(token)


def finished(name: str, module: Any) -> Any:
    """The makers' hand-over of a just-built large module, the pipeline's component ``name``:
    unchanged when nothing is being written, else written and emptied (module docstring)."""
    writer = _WRITER.get()
    if writer is None:
        return module
    if name in writer.written:
        raise ConfigError(f"two modules were built as the pipeline's {name!r}")
    save_module(module, writer.directory / name, max_shard_size=writer.max_shard_size)
    release(module)
    writer.written[name] = module
    writer.log.append(("written", name))
    return module


def save_kwargs(save: Any, *, max_shard_size: str) -> dict[str, Any]:
    """What ``DiffusionPipeline.save_pretrained`` passes a component's save method (with its
    defaults: safetensors, no variant), by what the method accepts."""
    accepts = inspect.signature(save).parameters
    wanted = {"safe_serialization": True, "variant": None, "max_shard_size": max_shard_size,
              "use_flashpack": False,
              # diffusers passes it to transformers >= 5 models (their keys as loaded)
              "save_peft_format": False}
    return {key: value for key, value in wanted.items() if key in accepts}


def save_module(module: Any, directory: Path, *, max_shard_size: str) -> None:
    """``module`` written to ``directory`` as a pipeline's save writes its component (from
    where it lives, a tensor at a time: the host holds about one shard)."""
    save = module.save_pretrained
    save(str(directory), **save_kwargs(save, max_shard_size=max_shard_size))


def release(module: Any) -> None:
    """Frees ``module``'s tensors, keeping the module (its config and shapes) on the meta
    device; a GPU's cached blocks go back too, so the next component is not fragmented."""
    import torch

    on_gpu = any(t.is_cuda for t in module.state_dict().values())
    torch.nn.Module.to(module, "meta")
    if on_gpu:
        torch.cuda.empty_cache()


def save_pipeline(pipe: Any, directory: str | Path, written: Mapping[str, Any], *,
                  max_shard_size: str = MAX_SHARD_SIZE) -> None:
    """Writes the rest of ``pipe`` by diffusers' ``save_pretrained``: the index, tokenizers,
    schedulers and unwritten modules; the ``written`` ones (already on disk, emptied) are
    skipped - each must be the pipeline's component of its name."""
    components = pipe.components
    for name, module in written.items():
        if components.get(name) is not module:
            raise ConfigError(f"the module written as {name!r} is not the pipeline's {name!r}")
    stubbed = [(module, module.__dict__.get("save_pretrained")) for module in written.values()]
    try:
        for module, _ in stubbed:
            module.save_pretrained = _written_already(module.save_pretrained)
        pipe.save_pretrained(str(directory), max_shard_size=max_shard_size)
    finally:
        for module, own in stubbed:
            del module.save_pretrained
            if own is not None:
                module.save_pretrained = own


def _written_already(save: Any) -> Any:
    """A stand-in for a written module's save method; ``wraps`` keeps its signature, which
    diffusers reads to choose the arguments (and a modular pipeline's index entries)."""

    @functools.wraps(save)
    def skip(*_: Any, **__: Any) -> None:
        return None

    return skip
