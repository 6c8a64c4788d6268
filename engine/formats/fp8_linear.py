"""``FP8Linear``: a linear layer with an e4m3 weight, per-output-channel fp32 weight scales and
per-token dynamic activation scales.

The module holds plain tensors - ``weight_fp8`` (float8_e4m3fn, (out, in)) and
``weight_scale`` (float32, (out,)) as buffers, ``bias`` as the original Parameter - so layer
offload treats them like any other block tensors: they land in the block's fp8 and fp32 flat
regions, stream together in one slab, and are repointed into the slot as views each time the
block loads. (torchao's ``Float8Tensor`` is a wrapper subclass that reports the bf16 dtype and
hides ``qdata``/``scale`` inside it, so the slab planner and ``param.data = view`` repointing
would not see its real storage; see docs/formats.md.)

Forward: quantize the activation per token (``fp8_quant``), then on CUDA one
``torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=(M, 1), scale_b=(1, N), bias, out_dtype=bf16)``
(A row-major, B column-major, K and N multiples of 16, rowwise scales fp32 and contiguous).
Elsewhere, an emulation with the same math: exact fp32 products of the e4m3 values, summed in
fp32, then scaled - so CPU tests check the plumbing and the numbers the kernel is asked for.
Eager, the activation quantization is separate kernels; under ``torch.compile`` it fuses.

Built by ``fp8_select.quantize_linears``; run inside the DiT's blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from ditserve.engine.errors import FormatError
from ditserve.engine.formats.fp8_quant import (
    FP8_DTYPE,
    dequantize,
    quantize_activation,
    quantize_weight,
)

# torch._scaled_mm needs K and N (in_features, out_features) to be multiples of 16.
SCALED_MM_MULTIPLE = 16


def fits_scaled_mm(in_features: int, out_features: int) -> bool:
    return in_features % SCALED_MM_MULTIPLE == 0 and out_features % SCALED_MM_MULTIPLE == 0


def fp8_matmul(
    x: torch.Tensor,
    weight_fp8: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    emulate: bool,
) -> torch.Tensor:
    """``x @ W.T + bias`` for a 2-D ``x`` (tokens, in) with W stored rowwise-quantized; the
    result in ``x.dtype``. ``emulate`` picks the CPU-capable path (see module docstring)."""
    x_fp8, x_scale = quantize_activation(x)
    if emulate:
        out = (x_fp8.float() @ weight_fp8.float().t()) * x_scale * weight_scale.view(1, -1)
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)
    # The rowwise kernel writes bf16 and takes a bf16 bias; another bias dtype is added after.
    fused_bias = bias if bias is not None and bias.dtype == torch.bfloat16 else None
    out = torch._scaled_mm(
        x_fp8, weight_fp8.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
        bias=fused_bias, out_dtype=torch.bfloat16,
    )
    if bias is not None and fused_bias is None:
        out = out + bias
    return out.to(x.dtype)


class FP8Linear(nn.Module):
    """Drop-in for ``nn.Linear`` at inference (see module docstring)."""

    weight_fp8: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(self, in_features: int, out_features: int, *, bias: nn.Parameter | None,
                 device: torch.device | None = None) -> None:
        super().__init__()
        if not fits_scaled_mm(in_features, out_features):
            raise FormatError(
                f"an FP8 linear needs in and out features divisible by {SCALED_MM_MULTIPLE} "
                f"(torch._scaled_mm), got {in_features} -> {out_features}; keep this layer "
                "in bf16")
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("weight_fp8", torch.zeros(
            (out_features, in_features), dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.ones(
            out_features, dtype=torch.float32, device=device))
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, work_device: torch.device | None = None) -> FP8Linear:
        """Quantize ``linear``'s weight (its bias Parameter is kept as is). The new tensors
        live where the weight does; ``work_device`` (e.g. the GPU for a DiT on the host)
        computes them there instead - the same values, rounding is elementwise."""
        weight = linear.weight
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias,
                    device=weight.device)
        q, scale = quantize_weight(weight if work_device is None else weight.to(work_device))
        layer.weight_fp8.copy_(q)
        layer.weight_scale.copy_(scale)
        return layer

    def dequantized_weight(self) -> torch.Tensor:
        """The fp32 weight this layer computes with (for error measurements)."""
        return dequantize(self.weight_fp8, self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_fp8.dtype != FP8_DTYPE or self.weight_scale.dtype != torch.float32:
            raise FormatError(
                f"FP8Linear tensors were cast to {self.weight_fp8.dtype}/"
                f"{self.weight_scale.dtype} (Module.to(dtype) casts every floating buffer); "
                "quantize after the model has its final dtype")
        lead = x.shape[:-1]
        out = fp8_matmul(x.reshape(-1, self.in_features), self.weight_fp8, self.weight_scale,
                         self.bias, emulate=x.device.type != "cuda")
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=float8_e4m3fn rowwise")
