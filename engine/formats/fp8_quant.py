"""Rowwise FP8 (e4m3) quantization: one fp32 scale per weight output channel or token row.

Convention (the one ``torch._scaled_mm`` uses): a quantized row ``q`` with scale ``s`` stands
for ``q.float() * s``, where ``s = amax(|row|) / 448`` (448: the largest finite e4m3fn value),
so each row uses the whole e4m3 range. Rounding is round-to-nearest-even, by ``Tensor.to``.

Weights are quantized once (load time) per output channel; activations per token on every
call (dynamic scaling), inside ``fp8_linear``, where ``torch.compile`` fuses it into one
kernel. Called by ``fp8_linear`` and ``fp8_select``; tests and ``bench/quality.py``.
"""

from __future__ import annotations

import torch

from ditserve.engine.errors import FormatError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
# A row of zeros gets this scale (its values quantize to 0 whatever it is) rather than 0,
# so dequantization never multiplies by 0 * inf.
MIN_SCALE = 1e-12


# Elements per slice of a large quantization: its float32 working copy stays at 256 MiB.
SLICE_ELEMENTS = 1 << 26


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) for a 2-D tensor: ``q`` e4m3 of the same shape, ``scale`` fp32 of shape
    (rows, 1) with ``values ~= q.float() * scale`` row by row.

    Eagerly, a slice of rows at a time into one preallocated ``q``, with one float32 copy
    per slice worked on in place: the whole-tensor expression would hold three float32
    copies of ``values`` at once (its upcast, the quotient, the clamp), which at a 720p
    video's ~88k tokens is several GiB per linear - the step's peak HBM. Rows are
    independent, so the result is bit-identical. Under ``torch.compile`` the expression
    stays whole: the compiler fuses it into one kernel without temporaries."""
    if values.dim() != 2:
        raise FormatError(f"rowwise quantization takes a 2-D tensor, got {values.dim()}-D")
    if torch.compiler.is_compiling():
        rows = values.float()
        scale = (rows.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        # e4m3fn has no inf: a value past 448 (fp32 rounding of the division) would cast to NaN.
        return (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    # |x| and its row maximum are exact in the input's dtype: the scale needs no upcast.
    scale = (values.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    q = torch.empty(values.shape, dtype=FP8_DTYPE, device=values.device)
    step = max(1, SLICE_ELEMENTS // max(1, values.shape[1]))
    for start in range(0, values.shape[0], step):
        part = slice(start, start + step)
        rows = values[part].to(torch.float32, copy=True)  # a copy: fp32 input is not touched
        q[part] = rows.div_(scale[part]).clamp_(-FP8_MAX, FP8_MAX)
    return q, scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear weight (out_features, in_features) as e4m3 plus a (out_features,) fp32 scale
    per output channel."""
    if not weight.is_floating_point() or weight.dtype == FP8_DTYPE:
        raise FormatError(f"quantize a floating-point weight in its high-precision dtype, "
                          f"got {weight.dtype}")
    q, scale = quantize_rows(weight.detach())
    return q.contiguous(), scale.reshape(-1).contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values rowwise-quantized ``q`` stands for; ``scale`` (rows,) or (rows, 1)."""
    return q.float() * scale.reshape(-1, 1).float()


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row) dynamic quantization of a (tokens, features) activation: e4m3 and a
    (tokens, 1) fp32 scale, the layout ``torch._scaled_mm`` takes as ``scale_a``."""
    return quantize_rows(x)
