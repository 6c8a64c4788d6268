"""An adapter file -> the low-rank factors it adds to each of the DiT's linear layers.

Called by the runner's ``AdapterBank`` (when an adapter becomes resident) and by the engine's
catalog (to check a file and learn its rank before a request names it). The conversion from
community formats is diffusers' own: the served pipeline class's ``lora_state_dict`` turns
kohya / ComfyUI Flux keys (``lora_unet_...``, ``lora_down``/``lora_up``, ``alpha``), the
non-diffusers Wan and Qwen-Image layouts and PEFT keys into diffusers' PEFT layout
(``transformer.<module>.lora_A.weight`` / ``lora_B.weight``). What PEFT would then do with
them - scale each module's delta by ``lora_alpha / r`` from the file's adapter metadata, the
network alphas, or 1 - is done here, so the result is exactly what ``load_lora_weights``
computes, without PEFT.

Only ``.safetensors`` files are read (a pickle could run code). Text-encoder parts are
refused: ditserve encodes prompts once per request, without per-request encoder weights.
Keys diffusers' converter maps to no component (kohya Flux's ``img_in``, ``time_in``, ...)
are dropped with a warning naming them, as ``load_lora_weights`` ignores them.
DoRA and LoRA biases are refused too.
"""

from __future__ import annotations

import collections
import inspect
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ditserve.engine.errors import AdapterError, AdapterFileNotFoundError

log = logging.getLogger(__name__)
DIT_PREFIXES = ("transformer", "transformer_2")
METADATA_KEY = "lora_adapter_metadata"  # diffusers' key in the safetensors header


@dataclass(frozen=True)
class LoraFactors:
    """One linear layer's adapter: delta(x) = scaling * (x @ down.T) @ up.T.

    down: (rank, in_features) - PEFT's lora_A; up: (out_features, rank) - lora_B."""

    down: torch.Tensor
    up: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def nbytes(self) -> int:
        return self.down.numel() * self.down.element_size() + self.up.numel() * self.up.element_size()


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter's factors by (DiT component, module name inside that component)."""

    path: str
    layers: dict[tuple[str, str], LoraFactors]

    @property
    def rank(self) -> int:
        return max(f.rank for f in self.layers.values())

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.layers.values())


def adapter_file(path: str | Path) -> Path:
    """The safetensors file of an adapter path: the file itself, or the one ``.safetensors``
    in a directory (``pytorch_lora_weights.safetensors`` when there are several)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        preferred = p / "pytorch_lora_weights.safetensors"
        if preferred in files:
            return preferred
        if not files:
            raise AdapterFileNotFoundError(f"adapter directory {str(p)!r} holds no "
                                           ".safetensors file")
        if len(files) != 1:
            raise AdapterError(f"adapter directory {str(p)!r} holds {len(files)} .safetensors "
                               "files; name the file itself")
        return files[0]
    if not p.is_file():
        raise AdapterFileNotFoundError(f"adapter file {str(p)!r} does not exist")
    if p.suffix != ".safetensors":
        raise AdapterError(f"adapter file {str(p)!r} is not a .safetensors file (pickled "
                           "checkpoints are not loaded: they can run code)")
    return p


def _read(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(file), device="cpu")
        with safe_open(str(file), framework="pt") as handle:
            header = handle.metadata() or {}
    except (OSError, SafetensorError) as e:
        raise AdapterError(f"cannot read adapter file {str(file)!r}: {e}") from e
    raw = header.get(METADATA_KEY)
    return tensors, (json.loads(raw) if raw else None)


def convert(pipeline_class: Any, tensors: dict[str, torch.Tensor]
            ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """diffusers' conversion of a LoRA state dict for ``pipeline_class``: (PEFT-layout
    tensors prefixed by component, network alphas by ``<component>.<module>.alpha``)."""
    from diffusers.utils import convert_unet_state_dict_to_peft

    if not hasattr(pipeline_class, "lora_state_dict"):
        # diffusers ships no LoRA loader for this pipeline (Cosmos3): no format to read.
        raise AdapterError(f"diffusers' {pipeline_class.__name__} has no LoRA loader, so "
                           "LoRA adapters are not served for this model; serve it without "
                           "--lora-modules / --lora")
    kwargs = {}
    if "return_alphas" in inspect.signature(pipeline_class.lora_state_dict).parameters:
        kwargs["return_alphas"] = True
    try:
        out = pipeline_class.lora_state_dict(dict(tensors), **kwargs)
    except (ValueError, KeyError, RuntimeError) as e:
        raise AdapterError(f"diffusers' {pipeline_class.__name__} cannot read this LoRA: "
                           f"{type(e).__name__}: {e}") from e
    state, alphas = out if isinstance(out, tuple) else (out, None)
    if state and not any("lora_A" in k or "lora_B" in k for k in state):
        state = convert_unet_state_dict_to_peft(state)  # lora.down / lora_linear_layer keys
    return state, dict(alphas or {})


def _pattern_value(patterns: dict[str, Any], module: str) -> Any:
    """PEFT's rank/alpha pattern lookup: a key matches a module name or its dotted tail."""
    for key, value in patterns.items():
        pattern = key.lstrip("^")
        if re.fullmatch(rf"(.*\.)?{re.escape(pattern)}", module) or module == pattern:
            return value
    return None


def _scalings(component: str, ranks: dict[str, int], alphas: dict[str, Any],
              metadata: dict[str, Any] | None) -> dict[str, float]:
    """lora_alpha / r per module, as diffusers builds PEFT's LoraConfig (``get_peft_kwargs``
    or the file's adapter metadata)."""
    meta = {k.removeprefix(f"{component}."): v for k, v in (metadata or {}).items()
            if k.startswith(f"{component}.")}
    mine = {k.removeprefix(f"{component}.").removesuffix(".alpha"): float(v)
            for k, v in alphas.items() if k.startswith(f"{component}.")}
    common_alpha = (collections.Counter(mine.values()).most_common(1)[0][0] if mine else None)
    out = {}
    for module, rank in ranks.items():
        if meta:
            alpha = _pattern_value(meta.get("alpha_pattern") or {}, module)
            alpha = float(meta.get("lora_alpha", rank) if alpha is None else alpha)
        elif mine:
            alpha = mine.get(module, common_alpha)
        else:
            alpha = float(rank)  # no alphas: W + B @ A (PEFT's lora_alpha == r)
        out[module] = float(alpha) / rank
    return out


def _drop_unmapped(state: dict[str, torch.Tensor], file: Path) -> dict[str, torch.Tensor]:
    """What ``load_lora_weights`` loads: the DiT's keys (prefixed by its component) and the
    text encoders'; it ignores the rest - kohya Flux files' non-block keys (``img_in``,
    ``time_in``, ...) come out of diffusers' converter without a component prefix and are
    never loaded. Dropped here too, and named in the log."""
    dropped = sorted(k for k in state if k.split(".")[0] not in DIT_PREFIXES
                     and not k.startswith("text_encoder"))
    if dropped:
        modules = sorted({k.rsplit(".lora_", 1)[0] for k in dropped})
        log.warning("%s: %d LoRA tensors are dropped, as diffusers' load_lora_weights drops "
                    "them (its converter maps them to no component): %s", file.name,
                    len(dropped), ", ".join(modules))
    return {k: v for k, v in state.items() if k not in set(dropped)}


def _refuse_unsupported(state: dict[str, torch.Tensor]) -> None:
    others = [k for k in state if k.split(".")[0] not in DIT_PREFIXES]
    if others:
        parts = sorted({k.split(".")[0] for k in others})
        raise AdapterError(
            f"this LoRA also adapts {', '.join(parts)} ({len(others)} tensors); ditserve "
            "applies LoRA to the DiT only (prompts are encoded without per-request encoder "
            "weights): save the adapter without its text-encoder part")
    if any("lora_magnitude_vector" in k or "dora_scale" in k for k in state):
        raise AdapterError("DoRA adapters are not supported; use a plain LoRA")
    if any("lora_B" in k and k.endswith(".bias") for k in state):
        raise AdapterError("LoRA biases (lora_bias) are not supported")
    if any(".lokr_" in k for k in state):
        raise AdapterError("LoKr adapters are not supported; use a plain LoRA")


def read_adapter(path: str | Path, pipeline_class: Any, *, max_rank: int) -> AdapterWeights:
    """The factors of the adapter at ``path`` for a model served by ``pipeline_class``
    (a diffusers pipeline class with LoRA loading), float32 on the CPU."""
    file = adapter_file(path)
    tensors, metadata = _read(file)
    if not tensors:
        raise AdapterError(f"adapter file {str(file)!r} holds no tensors")
    state, alphas = convert(pipeline_class, tensors)
    if state and not any(k.split(".")[0] in DIT_PREFIXES or k.startswith("text_encoder")
                         for k in state):
        # Keys without a component prefix (a DiT's own save_lora_adapter): the DiT's.
        state = {f"transformer.{k}": v for k, v in state.items()}
        alphas = {f"transformer.{k}": v for k, v in alphas.items()}
    state = _drop_unmapped(state, file)
    _refuse_unsupported(state)
    layers: dict[tuple[str, str], LoraFactors] = {}
    for component in DIT_PREFIXES:
        ups = {k.removeprefix(f"{component}.").removesuffix(".lora_B.weight"): v
               for k, v in state.items()
               if k.startswith(f"{component}.") and k.endswith(".lora_B.weight")}
        ranks = {module: int(up.shape[1]) for module, up in ups.items()}
        scalings = _scalings(component, ranks, alphas, metadata)
        for module, up in ups.items():
            down = state.get(f"{component}.{module}.lora_A.weight")
            if down is None or down.dim() != 2 or up.dim() != 2 or down.shape[0] != up.shape[1]:
                raise AdapterError(f"{file.name}: {component}.{module} has no matching "
                                   "lora_A/lora_B pair of 2-D factors")
            if ranks[module] > max_rank:
                raise AdapterError(f"{file.name}: {component}.{module} has rank "
                                   f"{ranks[module]}, above --max-lora-rank {max_rank}")
            layers[(component, module)] = LoraFactors(
                down=down.float().contiguous(), up=up.float().contiguous(),
                scaling=scalings[module])
    if not layers:
        raise AdapterError(f"adapter file {str(file)!r} holds no LoRA factors for the DiT "
                           f"(keys such as {sorted(tensors)[:3]})")
    return AdapterWeights(path=str(file), layers=layers)


LinearShapes = Mapping[str, tuple[int, int]]
"""``"<component>.<module>"`` -> (in_features, out_features) of every linear layer an
adapter may target (``AdapterBank.linear_shapes``)."""


def check_fits(weights: AdapterWeights, shapes: LinearShapes) -> None:
    """Refuse an adapter that names a layer the model lacks, or whose factors do not fit
    the layer: the same file would fail every request that names it."""
    components = sorted({name.split(".", 1)[0] for name in shapes})
    name = Path(weights.path).name
    for (component, module), factors in weights.layers.items():
        if component not in components:
            raise AdapterError(f"{name}: the adapter targets {component}; this model's DiTs "
                               f"are {', '.join(components)}")
        shape = shapes.get(f"{component}.{module}")
        if shape is None:
            raise AdapterError(f"{name}: the adapter targets {component}.{module}, which is "
                               "not a linear layer of this model: it was trained for another "
                               "model")
        fan_in, fan_out = shape
        if factors.down.shape[1] != fan_in or factors.up.shape[0] != fan_out:
            raise AdapterError(
                f"{name}: the adapter's factors for {component}.{module} are "
                f"{tuple(factors.up.shape)} x {tuple(factors.down.shape)}, but the layer is "
                f"{fan_in} -> {fan_out}: the adapter was trained for another model")


def rank_inspector(model_dir: str | Path, *, max_rank: int,
                   shapes: LinearShapes | None = None) -> Any:
    """path -> the adapter's rank, checking the file as a runner will read it for the model
    in ``model_dir`` (the engine's catalog calls it on every load); with ``shapes``, also
    that every layer it targets exists and fits (``check_fits``)."""
    import diffusers

    from ditserve.engine.weights.loader import read_model_index

    pipeline_class = getattr(diffusers, read_model_index(model_dir)[0])

    def inspect_file(path: str) -> int:
        weights = read_adapter(path, pipeline_class, max_rank=max_rank)
        if shapes is not None:
            check_fits(weights, shapes)
        return weights.rank

    return inspect_file
