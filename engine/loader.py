"""Loads a pipeline's components from a local diffusers directory; never downloads.

Called by the model runner (whole pipelines), by `cachectl build` (the DiT's final tensors)
and by benchmarks. Supported layouts are listed in ``SUPPORTED_PIPELINES``; anything else
fails with a message naming what was found.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ditserve.engine.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

# Bump when the tensors produced for the same inputs change (the cache keys on it).
LOADER_VERSION = "flux-loader-1"

SUPPORTED_PIPELINES: dict[str, tuple[str, ...]] = {
    "FluxPipeline": (
        "transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
        "scheduler",
    ),
}
DIT_COMPONENT = "transformer"


@dataclass
class LoadedComponents:
    """The pipeline's parts, on CPU, in the requested dtype (tokenizers and scheduler aside)."""

    pipeline_class: str
    model_dir: Path
    modules: dict[str, Any]


def read_model_index(model_dir: str | Path) -> tuple[str, dict[str, Any]]:
    """Validate the directory layout; return (pipeline class, model_index)."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelLoadError(
            f"model directory {str(root)!r} does not exist; pass --model a local diffusers "
            "directory (ditserve never downloads weights) or omit it to use the tiny model"
        )
    index_file = root / "model_index.json"
    if not index_file.is_file():
        raise ModelLoadError(
            f"{str(root)!r} has no model_index.json; it is not a diffusers pipeline directory"
        )
    try:
        index = json.loads(index_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{index_file} is not valid JSON: {e}") from e
    cls = index.get("_class_name")
    if cls not in SUPPORTED_PIPELINES:
        raise ModelLoadError(
            f"{str(root)!r} holds a {cls!r} pipeline; supported: {', '.join(SUPPORTED_PIPELINES)}"
        )
    missing = [
        name for name in SUPPORTED_PIPELINES[cls]
        if name not in index or not (root / name).is_dir()
    ]
    if missing:
        raise ModelLoadError(
            f"{str(root)!r} is incomplete: missing component(s) {', '.join(missing)}"
        )
    return cls, index


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name (``float32``, ``bfloat16``, ``float16``)."""
    import torch

    from ditserve.engine.config import DTYPES
    from ditserve.engine.errors import ConfigError

    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def dit_class() -> Any:
    """The DiT's model class (the offload loader builds it on the meta device)."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel


def load_dit(model_dir: str | Path, *, dtype: str) -> Any:
    """The DiT alone, ordinarily loaded onto the CPU (eval, no grad)."""
    read_model_index(model_dir)
    try:
        model = dit_class().from_pretrained(
            Path(model_dir), subfolder=DIT_COMPONENT, dtype=torch_dtype(dtype)
        )
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"could not load the DiT from {str(model_dir)!r}: {e}") from e
    return model.eval().requires_grad_(False)


def load_components(
    model_dir: str | Path, *, dtype: str = "float32", transformer: Any = None
) -> LoadedComponents:
    """Load every component of a supported pipeline onto the CPU.

    transformer: an already prepared DiT (the offload loader's, e.g. bound to a mapping);
    it is used as is instead of loading one.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer

    cls, _ = read_model_index(model_dir)
    _quiet_transformers()
    root = Path(model_dir)
    dit_dtype = torch_dtype(dtype)  # every module in the serving dtype
    try:
        modules: dict[str, Any] = {
            "transformer": transformer if transformer is not None else (
                FluxTransformer2DModel.from_pretrained(
                    root, subfolder="transformer", dtype=dit_dtype
                )
            ),
            "vae": AutoencoderKL.from_pretrained(root, subfolder="vae", dtype=dit_dtype),
            "text_encoder": CLIPTextModel.from_pretrained(
                root, subfolder="text_encoder", dtype=dit_dtype
            ),
            "text_encoder_2": T5EncoderModel.from_pretrained(
                root, subfolder="text_encoder_2", dtype=dit_dtype
            ),
            "tokenizer": CLIPTokenizer.from_pretrained(root, subfolder="tokenizer"),
            "tokenizer_2": T5Tokenizer.from_pretrained(root, subfolder="tokenizer_2"),
            "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(
                root, subfolder="scheduler"
            ),
        }
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"could not load {cls} from {str(root)!r}: {e}") from e
    for name in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        modules[name].eval().requires_grad_(False)
    return LoadedComponents(pipeline_class=cls, model_dir=root, modules=modules)


def _quiet_transformers() -> None:
    # transformers prints a per-component "Loading weights" bar; the engine reports its own progress.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def dit_source_files(model_dir: str | Path) -> list[Path]:
    """The files that determine the DiT's tensors (config and weights), sorted."""
    read_model_index(model_dir)
    folder = Path(model_dir) / DIT_COMPONENT
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not any(p.suffix == ".safetensors" for p in files):
        raise ModelLoadError(f"{str(folder)!r} has no .safetensors weights")
    return files


def load_dit_state_dict(model_dir: str | Path, *, dtype: str) -> dict[str, torch.Tensor]:
    """The DiT's final runtime tensors (parameters and persistent buffers), contiguous, on CPU."""
    from diffusers import FluxTransformer2DModel

    read_model_index(model_dir)
    try:
        model = FluxTransformer2DModel.from_pretrained(
            model_dir, subfolder=DIT_COMPONENT, dtype=torch_dtype(dtype)
        )
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"could not load the DiT from {str(model_dir)!r}: {e}") from e
    return {name: t.detach().contiguous() for name, t in model.state_dict().items()}
