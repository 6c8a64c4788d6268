"""The runtime dtype a model is served in when none is named: the dtype its DiT is stored in.

One rule for ``ditserve generate/serve`` (``cli_options``) and ``cachectl build``, so an entry
built without ``--dtype`` is the one an engine started without it looks up: a bf16 release
serves in bfloat16 (as ``torch_dtype=torch.bfloat16`` in its model card), the float32 tiny
models in float32. Pure (reads safetensors headers through ``cachectl.st_format``, no torch):
the operator judges engine options with the same code and must not load the runtime.
"""

from __future__ import annotations

from pathlib import Path

from ditserve.cachectl.st_header import stored_dtype
from ditserve.engine.errors import ModelLoadError
from ditserve.engine.families.base import index_file

AUTO_DTYPE = "auto"  # the option value that means "the checkpoint's own dtype"
EMBEDDED_MODEL_DTYPE = "float32"  # `ditserve model init-tiny` writes float32 weights
DIT_COMPONENT = "transformer"  # the first (or only) DiT of every family


def checkpoint_dtype(model_dir: str | Path | None, component: str = DIT_COMPONENT) -> str:
    """The floating type holding most of the bytes of ``<model_dir>/<component>``'s
    safetensors (``st_format.stored_dtype``); None is the embedded tiny model."""
    if model_dir is None:
        return EMBEDDED_MODEL_DTYPE
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelLoadError(
            f"model directory {str(root)!r} does not exist; pass --model a local diffusers "
            "directory (ditserve never downloads weights) or omit it to use the tiny model")
    if index_file(root) is None:
        raise ModelLoadError(
            f"{str(root)!r} is not a diffusers pipeline directory (no model_index.json); pass "
            "--model a local diffusers directory (ditserve never downloads weights)")
    files = sorted((root / component).glob("*.safetensors"))
    try:
        found = stored_dtype(files)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the weights of {str(root)!r}: {e}") from e
    if found is None:
        raise ModelLoadError(
            f"{str(root / component)!r} has no float32/bfloat16/float16 safetensors weights to "
            "take the runtime dtype from; pass --dtype")
    return found
