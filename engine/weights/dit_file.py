"""A DiT built from one checkpoint file (``--model FILE``), with its config from the base model.

The file is checked first (``checkpoint_file.inspect_checkpoint``: format, family, every
tensor inside the file), then its keys are mapped to diffusers' names on meta tensors and every
shape compared with the family's DiT built from ``--base-model``'s config: the first key that
is missing, extra or of another shape is refused with both shapes - all before a byte of
weights is read or any device memory taken. Then, by format:

- single file: the tensors, mapped, go through diffusers' ``from_single_file`` (its loading,
  dtype and ``_keep_in_fp32_modules`` rules), so the DiT equals the one a diffusers folder of
  the same weights gives, bit for bit;
- GGUF: diffusers' GGUF support (``load_gguf_checkpoint``, ``GGUFQuantizationConfig``): linear
  weights stay quantized as ``GGUFParameter`` bytes in ``GGUFLinear`` layers that dequantize on
  the fly, on the device they run on (resident, or streamed in their stored form by layerwise
  offload: the bytes are ordinary block tensors to it);
- FP8: e4m3 weights become the engine's ``FP8Linear`` layers (the ``--quantization fp8`` layer:
  rowwise fp32 scales, FP8 matmul on the device), with the file's scales honoured - ComfyUI's
  per-tensor ``scale_weight``, or the per-row ones ``model convert --to fp8`` writes; layers of
  a width ``torch._scaled_mm`` cannot take are dequantized into ``--dtype``.

Flux's BFL names are mapped by ``flux_keys`` (diffusers' converter hard-codes the released
width); other families' by diffusers' own single-file mapping functions (Wan's original names:
``convert_wan_transformer_to_diffusers``, whose inverse ``wan_keys`` is what ``convert``
writes; FLUX.2's BFL names and Z-Image's original ones likewise, with ``flux2_keys`` and
``z_image_keys`` as the inverses).

Called by ``weights.loader`` and ``weights.backing_choice`` when the model has a checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ditserve.engine.errors import ModelLoadError
from ditserve.engine.weights.checkpoint_file import (
    FP8_MARKERS,
    FP8_SCALE_SUFFIX,
    CheckpointFile,
    CheckpointFormat,
    inspect_checkpoint,
)

log = logging.getLogger(__name__)

# The allocator's alignment, which folder-loaded tensors have (see ``_own_storage``).
ALIGNMENT = 64
# A checkpoint's file dtype name (safetensors) -> torch dtype, for the meta shape check.
_META_DTYPE = torch.float32


def base_family_name(base_dir: str | Path) -> str:
    """The base model's family name as the key markers name it (variants share their base's
    DiT: Flux Kontext reads Flux files, Qwen-Image-Edit reads Qwen-Image's)."""
    from ditserve.engine.families import family_of_dit
    from ditserve.engine.weights.loader import model_family

    family = model_family(base_dir)
    owner = family_of_dit(family.dit_class)  # the family that declares the DiT: the base
    return (owner or family).name


def check_checkpoint(path: str | Path, base_dir: str | Path, *,
                     component: str = "transformer") -> CheckpointFile:
    """Inspect ``path`` and check it against the base model's DiT (module docstring); returns
    the inspected file. Raises ModelLoadError naming the file and the first mismatch."""
    info = inspect_checkpoint(path)
    want = base_family_name(base_dir)
    if info.family != want:
        raise ModelLoadError(
            f"{str(info.path)!r} holds a {info.family} DiT but the base model "
            f"{str(base_dir)!r} is {want}: pass a --base-model of the file's family")
    model = _meta_model(base_dir, component)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    weights, scales = _split_scales(info.tensors)
    meta = {k: torch.empty(t.shape, dtype=_META_DTYPE, device="meta") for k, t in weights.items()}
    mapped = {k: tuple(v.shape) for k, v in map_keys(info.family, meta, model).items()}
    for key, shape in expected.items():
        if key not in mapped:
            raise ModelLoadError(
                f"{str(info.path)!r} does not match the {info.family} DiT of {str(base_dir)!r}: "
                f"tensor {key} (shape {list(shape)} in the model) is missing from the file")
        if mapped[key] != shape:
            raise ModelLoadError(
                f"{str(info.path)!r} does not match the {info.family} DiT of {str(base_dir)!r}: "
                f"first mismatching tensor {key} is {list(mapped[key])} in the file but "
                f"{list(shape)} in the model")
    extra = [k for k in mapped if k not in expected]
    if extra:
        raise ModelLoadError(
            f"{str(info.path)!r} does not match the {info.family} DiT of {str(base_dir)!r}: "
            f"tensor {extra[0]} (shape {list(mapped[extra[0]])}) is not in the model "
            f"({len(extra)} such)")
    del scales
    return info


def load_dit_file(path: str | Path, base_dir: str | Path, *, dtype: str,
                  component: str = "transformer") -> nn.Module:
    """The DiT from ``path`` (checked first), on the CPU, eval and without grad."""
    info = check_checkpoint(path, base_dir, component=component)
    from ditserve.engine.weights.loader import torch_dtype

    torch_type = torch_dtype(dtype)
    try:
        if info.format is CheckpointFormat.FP8:
            model = _load_fp8(info, base_dir, component, torch_type)
        else:
            model = _load_with_diffusers(info, base_dir, component, torch_type)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"could not load the DiT from {str(info.path)!r}: {e}") from e
    log.info("loaded the %s DiT from %s (%s; stored %s)", info.family, info.path,
             info.format.value, "/".join(info.quant_types))
    return model.eval().requires_grad_(False)


def map_keys(family: str, checkpoint: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """``checkpoint`` (the file's names) in diffusers' names for ``model``'s class."""
    from ditserve.engine.weights import flux_keys

    if family == "flux":
        if flux_keys.is_bfl(checkpoint):
            return flux_keys.to_diffusers(checkpoint, cat=_cat)
        return dict(checkpoint)
    # ComfyUI-style prefixes (``model.diffusion_model.``): not every family's converter
    # strips them (FLUX.2's does not)
    checkpoint = {flux_keys.strip_prefix(k): v for k, v in checkpoint.items()}
    own = set(model.state_dict())
    if set(checkpoint) <= own:
        return dict(checkpoint)
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    classes: Any = SINGLE_FILE_LOADABLE_CLASSES
    mapping: Callable[..., dict[str, Any]] = classes[type(model).__name__]["checkpoint_mapping_fn"]
    config: Any = model.config
    return mapping(checkpoint=dict(checkpoint), config=dict(config))


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=0)


def _meta_model(base_dir: str | Path, component: str) -> nn.Module:
    from accelerate import init_empty_weights

    from ditserve.engine.weights.loader import dit_class

    cls = dit_class(base_dir, component)
    config = cls.load_config(str(base_dir), subfolder=component)
    with init_empty_weights():
        return cls.from_config(config)


def _split_scales(tensors: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(weights and other tensors, FP8 scales keyed by their weight's name); markers dropped."""
    weights, scales = {}, {}
    for name, value in tensors.items():
        if name.rsplit(".", 1)[-1] in FP8_MARKERS:  # ComfyUI writes it under the prefix too
            continue
        if name.endswith(FP8_SCALE_SUFFIX):
            scales[name[: -len(FP8_SCALE_SUFFIX)] + ".weight"] = value
        else:
            weights[name] = value
    return weights, scales


def _read_tensors(info: CheckpointFile) -> dict[str, torch.Tensor]:
    if info.format is CheckpointFormat.GGUF:
        from diffusers.models.model_loading_utils import load_gguf_checkpoint

        return dict(load_gguf_checkpoint(str(info.path)))
    from safetensors.torch import load_file

    return load_file(str(info.path))


def _load_with_diffusers(info: CheckpointFile, base_dir: str | Path, component: str,
                         torch_type: torch.dtype) -> nn.Module:
    from ditserve.engine.weights.loader import dit_class

    cls = dit_class(base_dir, component)
    model_for_names = _meta_model(base_dir, component)
    state = _own_storage(map_keys(info.family, _read_tensors(info), model_for_names))
    kwargs: dict[str, Any] = {}
    if info.format is CheckpointFormat.GGUF:
        from diffusers import GGUFQuantizationConfig

        kwargs["quantization_config"] = GGUFQuantizationConfig(compute_dtype=torch_type)
    # A dict already in diffusers' names: from_single_file loads it without converting.
    model = cls.from_single_file(state, config=str(base_dir), subfolder=component,
                                 torch_dtype=torch_type, **kwargs)
    if info.format is CheckpointFormat.GGUF:
        _own_gguf_layers(model, torch_type)
    return model


def _own_gguf_layers(model: nn.Module, torch_type: torch.dtype) -> None:
    """diffusers' ``GGUFLinear`` layers replaced: inside the repeated blocks by
    ``GGUFBlockLinear`` over the same bytes (plain buffers offload can stream as stored);
    outside them (embedders, final projection) by ordinary ``torch_type`` linears - small and
    always resident, so dequantizing them once costs a few MB and saves their per-step
    dequantization, and the step pipelines read the DiT's compute dtype from its first
    parameter (the timestep embedder's)."""
    from diffusers.quantizers.gguf.utils import GGUFLinear, dequantize_gguf_tensor

    from ditserve.engine.families import declared_block_lists

    lists = declared_block_lists(type(model).__name__) or ()
    for name, module in list(model.named_modules()):
        if not isinstance(module, GGUFLinear):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if not hasattr(module.weight, "quant_type"):
            continue  # a layer the file stores unquantized stays as diffusers built it
        if any(name.startswith(f"{b}.") for b in lists):
            setattr(parent, child, block_linear(module))
            continue
        linear = nn.Linear(module.in_features, module.out_features,
                           bias=module.bias is not None, device="meta")
        linear.weight = nn.Parameter(dequantize_gguf_tensor(module.weight).to(torch_type),
                                     requires_grad=False)
        if module.bias is not None:
            linear.bias = nn.Parameter(module.bias.data.to(torch_type), requires_grad=False)
        setattr(parent, child, linear)


def gguf_quant(quant_type: Any) -> Any:
    """The ``formats.gguf_linear.GGUFQuant`` of a GGUF type, with diffusers' dequantizer."""
    from diffusers.quantizers.gguf.utils import GGML_QUANT_SIZES, dequantize_functions
    from gguf import GGMLQuantizationType

    from ditserve.engine.formats.gguf_linear import GGUFQuant

    qtype = GGMLQuantizationType(int(quant_type))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return GGUFQuant(qtype.name, int(qtype), block_size, type_size, dequantize_functions[qtype])


def block_linear(layer: nn.Module) -> nn.Module:
    """diffusers' ``GGUFLinear`` as a ``GGUFBlockLinear`` over the same bytes (no copy)."""
    from ditserve.engine.formats.gguf_linear import GGUFBlockLinear

    weight: Any = layer.weight
    return GGUFBlockLinear(layer.in_features, layer.out_features,
                           weight_q=weight.as_tensor().detach().view(torch.uint8),
                           quant=gguf_quant(weight.quant_type), bias=layer.bias,
                           compute_dtype=layer.compute_dtype)


def _own_storage(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor in its own aligned allocation, as a diffusers folder's load gives them: a
    row slice of a fused tensor (q, k, v out of ``qkv``) is a view at an offset and
    safetensors' ``load_file`` returns tensors 8-byte aligned, and CPU matmul kernels take
    another path for such pointers, so outputs would differ from the folder's in the last bit.
    One tensor at a time, so the copies never double the whole model."""
    for key, tensor in state.items():
        if tensor.data_ptr() % ALIGNMENT or tensor.untyped_storage().nbytes() != tensor.nbytes:
            state[key] = tensor.clone()
    return state


def _load_fp8(info: CheckpointFile, base_dir: str | Path, component: str,
              torch_type: torch.dtype) -> nn.Module:
    from ditserve.engine.formats.fp8_linear import FP8Linear, fits_scaled_mm
    from ditserve.engine.weights.loader import keeps_float32

    model = _meta_model(base_dir, component)
    weights, scales = _split_scales(_read_tensors(info))
    state = map_keys(info.family, weights, model)
    row_scales = map_keys(info.family, _per_row(scales, weights), model) if scales else {}
    layers = 0
    for name, module in list(model.named_modules()):
        key = f"{name}.weight"
        if not isinstance(module, nn.Linear) or state.get(key) is None:
            continue
        if state[key].dtype != torch.float8_e4m3fn:
            continue
        q = state.pop(key)
        scale = row_scales.get(key, torch.ones(q.shape[0], 1)).float().reshape(-1)
        if not fits_scaled_mm(module.in_features, module.out_features):
            state[key] = (q.float() * scale.view(-1, 1)).to(torch_type)
            continue
        bias = state.pop(f"{name}.bias", None)
        layer = FP8Linear(module.in_features, module.out_features,
                          bias=None if bias is None else nn.Parameter(
                              bias.to(torch_type).clone(), requires_grad=False))
        layer.weight_fp8.copy_(q)
        layer.weight_scale.copy_(scale)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        layers += 1
    cls = type(model)
    cast = _own_storage({k: v.to(torch.float32 if keeps_float32(cls, k) else torch_type)
                         for k, v in state.items()})
    model.load_state_dict(cast, strict=False, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"{str(info.path)!r}: no tensor for {left[0]} ({len(left)} missing)")
    log.info("%s: %d FP8 linear layers kept in e4m3 (scales: %s)", info.path, layers,
             "per tensor/row from the file" if scales else "none in the file (1.0)")
    return model


def _per_row(scales: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]
             ) -> dict[str, torch.Tensor]:
    """Each scale as one fp32 value per weight row, (rows, 1): a per-tensor scale (ComfyUI)
    repeated, a per-row one kept; the key mapping then splits and joins them with the rows."""
    out = {}
    for key, scale in scales.items():
        rows = int(weights[key].shape[0]) if key in weights else scale.numel()
        flat = scale.float().reshape(-1)
        if flat.numel() == 1:
            flat = flat.expand(rows).clone()
        elif flat.numel() != rows:
            raise ModelLoadError(f"the FP8 scale of {key} has {flat.numel()} values for "
                                 f"{rows} rows: neither per tensor nor per row")
        out[key] = flat.reshape(rows, 1)
    return out
