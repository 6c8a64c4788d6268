"""The fused Q8_0 kernel on a CUDA device: diffusers' ``dequantize_blocks_Q8_0(...).to(dtype)``
on CUDA bit for bit (every fp16 scale pattern x every int8 value; quantized weights), into the
caller's tensor on the caller's stream without allocating or syncing the host; a GGUF Q8_0
linear's output unchanged by it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from diffusers.quantizers.gguf.utils import dequantize_blocks_Q8_0
from formats.test_gguf_q8_0 import (  # type: ignore[import-not-found]
    BLOCK_BYTES,
    BLOCK_VALUES,
    DTYPES,
    every_pattern,
    same_bits,
)

from ditserve.engine.formats import gguf_fused
from ditserve.engine.formats.gguf_fused import dequantize_into
from ditserve.engine.formats.gguf_linear import GGUFBlockLinear
from ditserve.engine.formats.gguf_quant import quantize
from ditserve.engine.weights.dit_file import gguf_quant

pytestmark = pytest.mark.gpu


def quantized(rows: int, cols: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(quantize((rng.standard_normal((rows, cols)) * 0.05)
                                     .astype(np.float32), "Q8_0"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_diffusers_for_every_scale_and_value(dtype: torch.dtype) -> None:
    blocks = every_pattern().cuda()
    want = dequantize_blocks_Q8_0(blocks, BLOCK_VALUES, BLOCK_BYTES).to(dtype)
    out = torch.empty(blocks.shape[0] * BLOCK_VALUES, dtype=dtype, device="cuda")
    got = dequantize_into("Q8_0", blocks, out).view(-1, BLOCK_VALUES)
    torch.cuda.synchronize()
    assert same_bits(got.cpu(), want.cpu())
    cpu = dequantize_into("Q8_0", every_pattern(), torch.empty(out.shape, dtype=dtype))
    assert same_bits(got.cpu(), cpu.view(-1, BLOCK_VALUES))


def test_kernel_into_a_slot_on_a_side_stream_without_allocation_or_host_sync() -> None:
    data = quantized(1001, 3104, 0).reshape(-1)  # 97097 blocks: the last tile is partial
    n = data.numel() // BLOCK_BYTES
    staging = torch.zeros(data.numel() + 3, dtype=torch.uint8, device="cuda")
    staging[1 : 1 + data.numel()].copy_(data)  # at an odd byte: the scales are unaligned
    blocks = staging[1 : 1 + data.numel()].view(n, BLOCK_BYTES)
    slot = torch.zeros(n * BLOCK_VALUES + 1000, dtype=torch.bfloat16, device="cuda")
    target = slot[200 : 200 + n * BLOCK_VALUES]  # not 16-byte aligned
    want = dequantize_blocks_Q8_0(data.view(n, BLOCK_BYTES).cuda(), BLOCK_VALUES,
                                  BLOCK_BYTES).to(torch.bfloat16).view(-1)
    dequantize_into("Q8_0", blocks, target)  # warm-up: compiles the kernel
    target.zero_()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
    try:
        with torch.cuda.stream(stream):
            dequantize_into("Q8_0", blocks, target)
            done = torch.cuda.Event()
            done.record(stream)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_allocated() == before
    done.synchronize()
    assert torch.equal(target.view(torch.int16), want.view(torch.int16))
    assert not slot[:200].any() and not slot[200 + n * BLOCK_VALUES :].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_q8_0_linear_output_unchanged_by_the_fused_kernel(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    from ditserve.engine.formats import gguf_triton

    launches = []
    launch = gguf_triton.dequantize_q8_0_cuda
    monkeypatch.setattr(gguf_triton, "dequantize_q8_0_cuda",
                        lambda *a, **k: launches.append(1) or launch(*a, **k))
    layer = GGUFBlockLinear(1024, 512, weight_q=quantized(512, 1024, 1).cuda(),
                            quant=gguf_quant(gguf.GGMLQuantizationType.Q8_0),
                            bias=None, compute_dtype=dtype)
    x = torch.randn(64, 1024, device="cuda").to(dtype)
    with torch.inference_mode():
        fused = layer(x)
        monkeypatch.setattr(gguf_fused, "FUSED", False)  # diffusers' dequantizer, then .to()
        plain = layer(x)
    assert launches == [1]
    assert torch.equal(fused, plain)
