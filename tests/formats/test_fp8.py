"""Rowwise FP8 on CPU: quantization bounds, the emulated FP8 linear against a reference from
the same quantized tensors, and which layers of a DiT the rule picks."""

from __future__ import annotations

import copy

import pytest
import torch
from formats.support import flux_inputs, tiny_flux  # type: ignore[import-not-found]
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ditserve.engine.errors import FormatError
from ditserve.engine.formats import fp8_quant
from ditserve.engine.formats.fp8_linear import FP8Linear, fp8_matmul
from ditserve.engine.formats.fp8_quant import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    dequantize,
    quantize_activation,
    quantize_weight,
)
from ditserve.engine.formats.fp8_select import FP8Rule, quantize_fp8, select_linears


def test_weight_quantization_is_rowwise_and_within_e4m3_rounding() -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-4, 2, 64).unsqueeze(1)  # rows of very different scale
    q, scale = quantize_weight(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (64,)
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / FP8_MAX)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((64,), FP8_MAX))
    err = (dequantize(q, scale) - w).abs()
    # 3 mantissa bits: half a unit in the last place is 2^-4 of the value (normal range), and
    # 2^-10 of the scale in the subnormal range (below 2^-6 * scale).
    bound = torch.maximum(w.abs() * 2**-4, scale.unsqueeze(1) * 2**-10) * (1 + 1e-6)
    assert (err <= bound).all()


def test_zero_rows_quantize_to_zero_without_nans() -> None:
    w = torch.zeros(16, 32)
    w[3] = torch.linspace(-1, 1, 32)
    q, scale = quantize_weight(w)
    assert scale[0] == MIN_SCALE and not dequantize(q, scale)[0].any()
    assert torch.isfinite(dequantize(q, scale)).all()


def test_activation_scales_are_per_token_in_scaled_mm_layout() -> None:
    x = torch.randn(5, 32) * torch.tensor([1e-3, 1.0, 10.0, 1e3, 0.5]).unsqueeze(1)
    q, scale = quantize_activation(x)
    assert scale.shape == (5, 1) and scale.is_contiguous()
    torch.testing.assert_close(dequantize(q, scale), x, rtol=2**-4, atol=0)


def whole_tensor_quantization(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule as one expression (what ``torch.compile`` fuses)."""
    rows = x.float()
    scale = (rows.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (rows / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sliced_quantization_is_bit_identical_and_leaves_the_input(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(3)
    x = (torch.randn(37, 48) * torch.logspace(-3, 3, 37).unsqueeze(1)).to(dtype)
    x[5] = 0
    before = x.clone()
    monkeypatch.setattr(fp8_quant, "SLICE_ELEMENTS", 48 * 8)  # 8 rows a slice, 5 slices
    q, scale = quantize_activation(x)
    q_ref, scale_ref = whole_tensor_quantization(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(x, before)


class LargestFloat32(TorchDispatchMode):
    """The most elements of any float32 tensor an op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.elements = max(self.elements, t.numel())
        return out


def test_activation_quantization_never_upcasts_the_whole_activation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At a 720p video's ~88k tokens a whole-activation float32 copy is GiBs per linear (three
    of them at once before the fix): the working copy is one slice."""
    monkeypatch.setattr(fp8_quant, "SLICE_ELEMENTS", 64 * 16, raising=False)
    x = torch.randn(256, 64, dtype=torch.bfloat16)
    with LargestFloat32() as seen:
        quantize_activation(x)
    assert 0 < seen.elements <= 64 * 16


def make_layer(in_features: int = 64, out_features: int = 48, *, bias: bool = True,
               dtype: torch.dtype = torch.float32) -> tuple[nn.Linear, FP8Linear]:
    torch.manual_seed(1)
    linear = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    return linear, FP8Linear.from_linear(copy.deepcopy(linear))


def test_emulation_equals_the_dequantized_reference() -> None:
    _, layer = make_layer()
    x = torch.randn(3, 7, 64)
    qx, sx = quantize_activation(x.reshape(-1, 64))
    reference = (dequantize(qx, sx).double() @ layer.dequantized_weight().double().t()
                 + layer.bias.double())
    got = layer(x)
    assert got.shape == (3, 7, 48) and got.dtype == torch.float32
    torch.testing.assert_close(got.reshape(-1, 48).double(), reference, rtol=1e-5, atol=1e-6)


def test_fp8_linear_is_close_to_the_bf16_linear() -> None:
    linear, layer = make_layer(256, 128)
    x = torch.randn(32, 256)
    want, got = linear(x), layer(x)
    assert ((got - want).norm() / want.norm()) < 0.05


def test_emulation_matches_torch_scaled_mm_on_cpu() -> None:
    # torch's CPU _scaled_mm checks the operand layouts and scale shapes the CUDA path uses.
    _, layer = make_layer(dtype=torch.bfloat16)
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    args = (x, layer.weight_fp8, layer.weight_scale, layer.bias)
    emulated = fp8_matmul(*args, emulate=True)
    kernel = fp8_matmul(*args, emulate=False)
    assert kernel.dtype == emulated.dtype == torch.bfloat16
    torch.testing.assert_close(kernel, emulated, rtol=1e-2, atol=1e-2)


def test_cast_tensors_are_refused_and_bad_shapes_too() -> None:
    _, layer = make_layer()
    layer.to(torch.bfloat16)  # casts the fp8 weight and the fp32 scale too
    with pytest.raises(FormatError, match="final dtype"):
        layer(torch.randn(2, 64, dtype=torch.bfloat16))
    with pytest.raises(FormatError, match="divisible by 16"):
        FP8Linear.from_linear(nn.Linear(20, 32))


def test_flux_rule_quantizes_block_linears_only() -> None:
    model = tiny_flux()
    chosen = select_linears(model)
    # 2 double blocks x 14 linears + 3 single blocks x 6.
    assert len(chosen.quantize) == 2 * 14 + 3 * 6
    assert all(n.startswith(("transformer_blocks.", "single_transformer_blocks."))
               for n in chosen.quantize)
    assert {"transformer_blocks.0.norm1.linear", "single_transformer_blocks.2.norm.linear",
            "transformer_blocks.1.attn.to_add_out"} <= set(chosen.quantize)
    for resident in ("x_embedder", "context_embedder", "proj_out", "norm_out.linear",
                     "time_text_embed.timestep_embedder.linear_1"):
        assert chosen.kept[resident] == "outside the streamed blocks"
    without = select_linears(model, FP8Rule(include_modulation=False))
    assert len(without.quantize) == len(chosen.quantize) - (2 * 2 + 3)
    assert without.kept["transformer_blocks.0.norm1_context.linear"] == "modulation"
    assert without.kept["single_transformer_blocks.0.norm.linear"] == "modulation"


def test_quantized_tiny_flux_runs_close_to_bf16_and_holds_plain_tensors() -> None:
    model = tiny_flux()
    inputs = flux_inputs(model)
    with torch.no_grad():
        want = model(**inputs)[0]
    report = quantize_fp8(model)
    assert report.layers == 46
    assert report.fp8_bytes < 0.3 * report.bf16_bytes  # fp32 model: 4 bytes -> 1 (+ scales)
    block = model.transformer_blocks[0]  # type: ignore[index]
    assert isinstance(block.attn.to_q, FP8Linear)
    dtypes = {t.dtype for t in list(block.parameters()) + list(block.buffers())}
    assert dtypes == {torch.float32, FP8_DTYPE}  # what a slab planner sees: plain tensors
    assert "transformer_blocks.0.ff.net.2.weight_scale" in model.state_dict()
    with torch.no_grad():
        got = model(**inputs)[0]
    assert 0 < ((got - want).norm() / want.norm()) < 0.02


def test_other_families_and_explicit_block_lists() -> None:
    from diffusers import QwenImageTransformer2DModel, WanTransformer3DModel

    qwen = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4))
    chosen = select_linears(qwen, FP8Rule(include_modulation=False))
    assert chosen.kept["transformer_blocks.1.img_mod.1"] == "modulation"
    assert "transformer_blocks.1.img_mlp.net.2" in chosen.quantize
    assert chosen.kept["img_in"] == "outside the streamed blocks"
    wan = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2)
    names = select_linears(wan).quantize
    assert len(names) == 2 * 10 and "blocks.0.attn2.to_out.0" in names

    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32)) for _ in range(2))
            self.head = nn.Linear(32, 16)

    with pytest.raises(FormatError, match="block_lists"):
        select_linears(Custom())
    assert select_linears(Custom(), FP8Rule(block_lists=("layers",))).quantize == (
        "layers.0.0", "layers.1.0")
