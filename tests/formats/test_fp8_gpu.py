"""FP8 on a CUDA device (sm89+): ``torch._scaled_mm`` against the emulation, under
``torch.compile`` too, and a quantized tiny Flux in bf16."""

from __future__ import annotations

import copy

import pytest
import torch
from formats.support import flux_inputs, tiny_flux  # type: ignore[import-not-found]
from torch import nn

from ditserve.engine.formats.fp8_linear import FP8Linear, fp8_matmul
from ditserve.engine.formats.fp8_select import quantize_fp8

pytestmark = pytest.mark.gpu


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
def test_scaled_mm_matches_emulation(bias_dtype: torch.dtype | None) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(3072, 1536, bias=bias_dtype is not None).cuda().to(torch.bfloat16)
    layer = FP8Linear.from_linear(linear)
    if bias_dtype is not None:
        layer.bias = nn.Parameter(layer.bias.to(bias_dtype), requires_grad=False)
    x = torch.randn(333, 3072, device="cuda", dtype=torch.bfloat16)
    args = (x, layer.weight_fp8, layer.weight_scale, layer.bias)
    kernel = fp8_matmul(*args, emulate=False)
    emulated = fp8_matmul(*args, emulate=True)
    assert kernel.dtype == torch.bfloat16 and kernel.shape == (333, 1536)
    assert rel(kernel, emulated) < 5e-3  # same math; bf16 output rounding and sum order
    assert rel(kernel, linear(x)) < 0.05


def test_compiled_fp8_linear_runs_and_matches_eager() -> None:
    torch.manual_seed(1)
    # Frozen, as every engine model is (requires_grad_(False)): _scaled_mm has no backward, so
    # a trainable bias would make dynamo trace an autograd graph it cannot build.
    linear = nn.Linear(1024, 4096).cuda().to(torch.bfloat16).requires_grad_(False)
    layer = FP8Linear.from_linear(linear)
    x = torch.randn(2, 257, 1024, device="cuda", dtype=torch.bfloat16)
    eager = layer(x)
    compiled = torch.compile(layer, fullgraph=True)(x)
    assert compiled.shape == eager.shape == (2, 257, 4096)
    assert rel(compiled, eager) < 5e-3


def test_quantized_tiny_flux_on_cuda_matches_its_cpu_emulation() -> None:
    model = tiny_flux()
    quantize_fp8(model)
    inputs = flux_inputs(model)
    with torch.no_grad():
        on_cpu = model(**inputs)[0]
        gpu_model = copy.deepcopy(model).cuda()
        on_gpu = gpu_model(**{k: v.cuda() if isinstance(v, torch.Tensor) else v
                              for k, v in inputs.items()})[0]
    # fp32 activations on CUDA: the kernel returns bf16 and the layer casts back, so the
    # difference is bf16 rounding of every linear's output.
    assert rel(on_gpu.cpu(), on_cpu) < 0.02
