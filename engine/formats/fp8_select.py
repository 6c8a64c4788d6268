"""Which linear layers of a DiT run in FP8, and the swap of those layers for ``FP8Linear``.

The rule is by name: the block lists come from the DiT's family record
(``engine.families``, ``Family.block_lists``), and within them the modulation linears match
one pattern (``MODULATION``). For the registered families:

==========  ===================================  ===============================================
family's    streamed block lists                 modulation linears (in blocks)
DiT
==========  ===================================  ===============================================
Flux        transformer_blocks,                  norm1.linear, norm1_context.linear,
            single_transformer_blocks            norm.linear
Qwen-Image  transformer_blocks                   img_mod.1, txt_mod.1
Wan         blocks                               (none: a scale_shift_table)
==========  ===================================  ===============================================

- FP8: every ``nn.Linear`` inside the block lists - attention projections, MLPs and (by
  default, see ``FP8Rule.include_modulation``) the adaLN modulation linears. These hold
  almost all block bytes, which is what DLO streams.
- bf16: everything outside the blocks (patch/text/time embedders, ``norm_out``'s modulation,
  the final ``proj_out``), every norm and non-linear parameter, and any linear whose features
  are not multiples of 16 (``torch._scaled_mm``'s constraint).

Why modulation is FP8 by default: on the random Flux models, quantizing the modulation linears
as well raises the output error from 0.33% to 0.39% (small model; 0.63% to 0.68% on the tiny
one; docs/formats.md), while they hold 27% of the block linears' bytes - keeping them bf16
would leave FP8 blocks at ~0.6x instead of 0.5x of the bf16 stream. Trained weights can
differ (``bench/quality.py --keep-modulation`` measures it): ``include_modulation=False``
keeps them bf16.

Other classes: pass ``block_lists`` (the offload discovery's list names) and the generic name
rule applies (``norm*.linear`` and ``*_mod.<i>`` are modulation).

Called by ``engine.weights.quantize`` (``--quantization fp8``, after loading), tests and benchmarks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ditserve.engine.errors import FormatError
from ditserve.engine.families import FAMILIES, declared_block_lists
from ditserve.engine.formats.fp8_linear import FP8Linear, fits_scaled_mm

# A linear's path inside its block: adaLN modulation (Flux ``norm1.linear``, Qwen-Image
# ``img_mod.1``, Z-Image ``adaLN_modulation.0``). They map the timestep embedding to
# shift/scale/gate vectors.
MODULATION = re.compile(r"(^|\.)(norm\w*\.linear|\w+_mod\.\d+|adaLN_modulation\.\d+)$")


@dataclass(frozen=True)
class FP8Rule:
    """What to quantize. ``block_lists`` None: the family table's entry for the model."""

    include_modulation: bool = True
    block_lists: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Selection:
    """The linears to quantize (qualified names, model order) and why the others are kept."""

    quantize: tuple[str, ...]
    kept: dict[str, str] = field(default_factory=dict)  # name -> reason


@dataclass(frozen=True)
class QuantizeReport:
    layers: int
    bf16_bytes: int  # weight bytes of those layers before (in their dtype)
    fp8_bytes: int  # fp8 weights + fp32 scales after

    def to_dict(self) -> dict[str, int]:
        return {"layers": self.layers, "weight_bytes_before": self.bf16_bytes,
                "weight_bytes_after": self.fp8_bytes}


def block_lists_of(model: nn.Module, rule: FP8Rule) -> tuple[str, ...]:
    if rule.block_lists is not None:
        return rule.block_lists
    name = type(model).__name__
    lists = declared_block_lists(name)  # the family registry's, as offload discovers them
    if lists is None:
        raise FormatError(
            f"no FP8 layer rule for {name}; known: "
            f"{', '.join(dict.fromkeys(f.dit_class for f in FAMILIES))} "
            "(pass FP8Rule(block_lists=...) with the model's streamed block lists)")
    return lists


def select_linears(model: nn.Module, rule: FP8Rule | None = None) -> Selection:
    """Apply ``rule`` (default ``FP8Rule()``) to ``model``'s linear layers."""
    rule = rule or FP8Rule()
    lists = block_lists_of(model, rule)
    for list_name in lists:
        if not isinstance(model.get_submodule(list_name), nn.ModuleList):
            raise FormatError(f"{type(model).__name__}.{list_name} is not a block list")
    chosen: list[str] = []
    kept: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        in_block = next((lst for lst in lists if name.startswith(lst + ".")), None)
        if in_block is None:
            kept[name] = "outside the streamed blocks"
            continue
        inner = name[len(in_block) + 1 :].split(".", 1)[-1]  # drop "<list>.<index>."
        if not rule.include_modulation and MODULATION.search(inner):
            kept[name] = "modulation"
        elif not fits_scaled_mm(module.in_features, module.out_features):
            kept[name] = "features not a multiple of 16"
        else:
            chosen.append(name)
    return Selection(tuple(chosen), kept)


def quantize_linears(model: nn.Module, names: tuple[str, ...] | list[str], *,
                     work_device: torch.device | None = None) -> QuantizeReport:
    """Replace each named ``nn.Linear`` of ``model`` by its ``FP8Linear``, in place.

    Call it once the model has its final dtype and before layer offload is enabled (offload
    plans the blocks' flat regions from the tensors it finds). ``work_device``: quantize
    there, one layer at a time, keeping the results where the weights are (a DiT on the host
    for offload, quantized by the GPU in seconds instead of minutes of CPU time).
    """
    before = after = 0
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if not isinstance(linear, nn.Linear):
            raise FormatError(f"{name} is a {type(linear).__name__}, not an nn.Linear")
        layer = FP8Linear.from_linear(linear, work_device=work_device)
        before += linear.weight.numel() * linear.weight.element_size()
        after += layer.weight_fp8.numel() + 4 * layer.weight_scale.numel()
        setattr(parent, child, layer)
    return QuantizeReport(len(names), before, after)


def quantize_fp8(model: nn.Module, rule: FP8Rule | None = None, *,
                 work_device: torch.device | None = None) -> QuantizeReport:
    """``select_linears`` then ``quantize_linears``: the one call a loader makes."""
    return quantize_linears(model, select_linears(model, rule).quantize, work_device=work_device)
