"""``ditserve model convert``: a diffusers folder's DiT written as one checkpoint file in the
layouts other tools read.

- ``single-file``: safetensors in BFL's key names for Flux (``flux1-dev.safetensors``, what
  ComfyUI and diffusers' ``from_single_file`` read) and FLUX.2 (``weights.flux2_keys``), in
  Wan's original names for Wan (``weights.wan_keys``: Wan-AI's and Comfy-Org's files), in
  Tongyi-MAI's original names for Z-Image (``weights.z_image_keys``), the tensors as stored;
- ``gguf:<type>`` (Q8_0, Q4_K, Q4_0, Q4_1, Q5_0, Q5_1): GGUF in the same names, as city96's
  Flux and Wan files (``general.architecture`` the family: ``flux``, ``wan``, ``flux2``,
  ``z-image``): 2-D weights whose rows fit
  the type's block are quantized; 1-D tensors, ones of at most 1024 values and ones of more
  than two dimensions (Wan's 5-D patch embedding, F32 in city96's files) stay F32; other
  weights F16 (a tiny model's narrow layers, or 64-wide inputs under a K-quant's 256-value
  blocks);
- ``fp8``: the linears ``--quantization fp8`` quantizes (the blocks' layers), as e4m3 with one
  fp32 scale per row stored as ComfyUI's ``<layer>.scale_weight`` of shape (rows, 1) (a
  broadcastable multiplier, as ComfyUI applies its per-tensor ones), plus its ``scaled_fp8``
  marker; every other tensor as stored.

Qwen-Image's single files use diffusers' own names, which it writes as they are. A folder with
two DiTs (Wan 2.2's experts) is refused: a file holds one. Called by the CLI (``engine.cli.convert``), benchmarks and tests.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ditserve.engine.errors import ConfigError, ModelLoadError
from ditserve.engine.weights.checkpoint_file import (
    CONVERT_TARGETS,
    FP8_SCALE_SUFFIX,
)

log = logging.getLogger(__name__)

TARGETS = CONVERT_TARGETS  # the forms ``convert`` writes (spelled torch-free for the CLI)
# city96's rule: tensors this small stay unquantized (F32).
SMALL_TENSOR = 1024
# The families ``convert`` writes, with their file layout (BFL's, diffusers', Wan's original).
FILE_FAMILIES = ("flux", "qwen-image", "wan", "flux2", "z-image")


@dataclass(frozen=True)
class ConvertReport:
    """What was written: the file, its bytes, its tensors, and how many of the model's linear
    layers took the target type (a fused file tensor may hold several)."""

    path: Path
    bytes: int
    tensors: int
    quantized: int


def convert(src: str | Path, dst: str | Path, *, to: str,
            component: str = "transformer") -> ConvertReport:
    """Write ``src``'s DiT ``component`` to ``dst`` in form ``to`` (one of ``TARGETS``)."""
    if to not in TARGETS:
        raise ConfigError(f"--to must be one of {', '.join(TARGETS)}, got {to!r}")
    from ditserve.engine.weights.dit_file import base_family_name

    family = base_family_name(src)
    if family not in FILE_FAMILIES:
        raise ConfigError(f"model convert writes {', '.join(FILE_FAMILIES)} DiTs; "
                          f"{str(src)!r} is {family}")
    from ditserve.engine.weights.loader import DIT_COMPONENT, dit_components

    dits = dit_components(src)
    if dits != (DIT_COMPONENT,):
        raise ConfigError(f"{str(src)!r} has several DiTs ({', '.join(dits)}); a checkpoint "
                          "file holds one, and ditserve serves files of one-DiT models only")
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if to == "fp8":
        state, quantized = _fp8_state(src, component)
    else:
        state, quantized = _stored_state(src, component), 0
    state = _file_names(family, state)
    if to.startswith("gguf:"):
        quantized = write_gguf(state, dst, qtype=to.split(":", 1)[1], arch=family)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(dst),
                  metadata={"format": "pt", "ditserve.convert": to})
    report = ConvertReport(dst, dst.stat().st_size, len(state), quantized)
    log.info("wrote %s: %d tensors (%d of the model's linear layers in %s), %.2f GiB", dst,
             report.tensors, quantized, to, report.bytes / 2**30)
    return report


def _stored_state(src: str | Path, component: str) -> dict[str, torch.Tensor]:
    """The DiT's tensors as its folder stores them (no dtype change)."""
    from safetensors.torch import load_file

    folder = Path(src) / component
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{str(folder)!r} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _fp8_state(src: str | Path, component: str) -> tuple[dict[str, torch.Tensor], int]:
    """The DiT with ``--quantization fp8``'s layers quantized, in file form: e4m3 weights and
    (rows, 1) scales under ``<layer>.scale_weight``, and ComfyUI's marker."""
    from ditserve.engine.formats.fp8_linear import FP8Linear
    from ditserve.engine.weights.loader import load_dit
    from ditserve.engine.weights.quantize import quantize_dit

    stored = _stored_state(src, component)
    dtype = next(iter(stored.values())).dtype
    del stored
    model = load_dit(src, dtype=str(dtype).removeprefix("torch."), component=component)
    # On an sm89+ GPU the layers are quantized there, one at a time (the same values:
    # the rounding is elementwise), results kept on the host; else on the CPU.
    from ditserve.engine.weights.quantize import FP8_MIN_CAPABILITY

    fast = torch.cuda.is_available() and torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY
    quantize_dit(model, "fp8", device=torch.device("cuda" if fast else "cpu"))
    state: dict[str, torch.Tensor] = {}
    layers = 0
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            state[f"{name}.weight"] = module.weight_fp8
            state[f"{name}{FP8_SCALE_SUFFIX}"] = module.weight_scale.reshape(-1, 1)
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias.data
            layers += 1
    for name, tensor in model.state_dict().items():
        owner = name.rpartition(".")[0]
        if not isinstance(model.get_submodule(owner) if owner else model, FP8Linear):
            state[name] = tensor
    state["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    return state, layers


def _file_names(family: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' names -> the file layout (Flux: BFL's; Wan: its original names; Qwen-Image:
    diffusers' own), FP8 scales mapped with their weights."""
    rename = _RENAMES.get(family)
    if rename is None:
        return state
    scales = {k[: -len(FP8_SCALE_SUFFIX)] + ".weight": v for k, v in state.items()
              if k.endswith(FP8_SCALE_SUFFIX)}
    rest = {k: v for k, v in state.items() if not k.endswith(FP8_SCALE_SUFFIX)}
    marker = {k: rest.pop(k) for k in ("scaled_fp8",) if k in rest}
    out = rename(rest)
    for key, scale in rename(scales).items():
        out[key[: -len(".weight")] + FP8_SCALE_SUFFIX] = scale
    out.update(marker)
    return out


def _flux_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from ditserve.engine.weights.flux_keys import to_bfl

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts, dim=0)

    return to_bfl(state, cat=cat)


def _wan_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from ditserve.engine.weights.wan_keys import to_original

    return to_original(state)


def _flux2_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from ditserve.engine.weights.flux2_keys import to_original

    return to_original(state, cat=_cat_rows)


def _z_image_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from ditserve.engine.weights.z_image_keys import to_original

    return to_original(state, cat=_cat_rows)


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=0)


# The families whose files use other names than diffusers' (Qwen-Image's use diffusers').
_RENAMES = {"flux": _flux_names, "wan": _wan_names, "flux2": _flux2_names,
            "z-image": _z_image_names}


def write_gguf(state: dict[str, torch.Tensor], dst: Path, *, qtype: str, arch: str,
               threads: int | None = None) -> int:
    """``state`` as a GGUF file of ``qtype`` under its own names (module docstring's rules for
    which tensors quantize); returns how many did. ``threads``: tensors quantized at once
    (numpy releases the GIL in its array loops; default: the CPU count)."""
    import gguf

    from ditserve.engine.formats.gguf_quant import quantize

    target = gguf.GGMLQuantizationType[qtype]
    block, _ = gguf.GGML_QUANT_SIZES[target]

    def encode(tensor: torch.Tensor) -> tuple[Any, gguf.GGMLQuantizationType | None]:
        values: Any = tensor.float().numpy()
        if tensor.dim() != 2 or tensor.numel() <= SMALL_TENSOR:
            return values.astype("float32"), None
        if tensor.shape[-1] % block == 0:
            return quantize(values, qtype), target
        return values.astype("float16"), None

    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(_FILE_TYPES[qtype])
    names = list(state)
    with ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1) as pool:
        encoded = pool.map(encode, (state[n] for n in names))
        quantized = 0
        for name, (data, raw_type) in zip(names, encoded, strict=True):
            if raw_type is None:
                writer.add_tensor(name, data)
            else:
                writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=raw_type)
                quantized += 1
    writer.write_header_to_file(path=dst)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return quantized


# GGUF's ``general.file_type`` (llama.cpp's LlamaFileType) of each written type.
_FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q4_K": 15}
