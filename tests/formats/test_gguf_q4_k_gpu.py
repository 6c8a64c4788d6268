"""The fused Q4_K kernel on a CUDA device: diffusers' ``dequantize_blocks_Q4_K(...).to(dtype)``
on CUDA bit for bit (every scale-and-min combination, every fp16 ``d``/``dmin`` pattern, every
code byte; quantized weights), into the caller's tensor on the caller's stream without
allocating or syncing the host; a GGUF Q4_K linear's output and the slot codec's weights
unchanged by it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from formats.test_gguf_q4_k import (  # type: ignore[import-not-found]
    BLOCK_BYTES,
    BLOCK_VALUES,
    diffusers_q4_k,
    every_pattern,
)
from formats.test_gguf_q8_0 import DTYPES, same_bits  # type: ignore[import-not-found]

from ditserve.engine.formats import gguf_fused
from ditserve.engine.formats.gguf_fused import dequantize_into
from ditserve.engine.formats.gguf_linear import GGUFBlockLinear
from ditserve.engine.formats.gguf_quant import quantize
from ditserve.engine.formats.slot_codecs import GGUFCodec, GGUFRun
from ditserve.engine.weights.dit_file import gguf_quant

pytestmark = pytest.mark.gpu


def quantized(qtype: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(quantize((rng.standard_normal((rows, cols)) * 0.05)
                                     .astype(np.float32), qtype))


def counting_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one per launch of the Q4_K kernel."""
    from ditserve.engine.formats import gguf_triton

    launches: list[int] = []
    launch = gguf_triton.dequantize_q4_k_cuda
    monkeypatch.setattr(gguf_triton, "dequantize_q4_k_cuda",
                        lambda *a, **k: launches.append(1) or launch(*a, **k))
    return launches


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_diffusers_for_every_scale_pattern(dtype: torch.dtype) -> None:
    blocks = every_pattern().cuda()
    want = diffusers_q4_k(blocks).to(dtype)  # diffusers' own ops on CUDA
    out = torch.empty(blocks.shape[0] * BLOCK_VALUES, dtype=dtype, device="cuda")
    got = dequantize_into("Q4_K", blocks, out).view(-1, BLOCK_VALUES)
    torch.cuda.synchronize()
    assert same_bits(got.cpu(), want.cpu())
    cpu = dequantize_into("Q4_K", every_pattern(), torch.empty(out.shape, dtype=dtype))
    assert same_bits(got.cpu(), cpu.view(-1, BLOCK_VALUES))


def test_kernel_into_a_slot_on_a_side_stream_without_allocation_or_host_sync() -> None:
    data = quantized("Q4_K", 1001, 3072, 0).reshape(-1)  # 12012 blocks: a partial last tile
    n = data.numel() // BLOCK_BYTES
    staging = torch.zeros(data.numel() + 3, dtype=torch.uint8, device="cuda")
    staging[1 : 1 + data.numel()].copy_(data)  # at an odd byte: the scales are unaligned
    blocks = staging[1 : 1 + data.numel()].view(n, BLOCK_BYTES)
    slot = torch.zeros(n * BLOCK_VALUES + 1000, dtype=torch.bfloat16, device="cuda")
    target = slot[200 : 200 + n * BLOCK_VALUES]  # not 16-byte aligned
    want = diffusers_q4_k(data.view(n, BLOCK_BYTES).cuda()).to(torch.bfloat16).view(-1)
    dequantize_into("Q4_K", blocks, target)  # warm-up: compiles the kernel
    target.zero_()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
    try:
        with torch.cuda.stream(stream):
            dequantize_into("Q4_K", blocks, target)
            done = torch.cuda.Event()
            done.record(stream)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_allocated() == before
    done.synchronize()
    assert torch.equal(target.view(torch.int16), want.view(torch.int16))
    assert not slot[:200].any() and not slot[200 + n * BLOCK_VALUES :].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_q4_k_linear_output_unchanged_by_the_fused_kernel(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    launches = counting_launches(monkeypatch)
    layer = GGUFBlockLinear(1024, 512, weight_q=quantized("Q4_K", 512, 1024, 1).cuda(),
                            quant=gguf_quant(gguf.GGMLQuantizationType.Q4_K),
                            bias=None, compute_dtype=dtype)
    x = torch.randn(64, 1024, device="cuda").to(dtype)
    with torch.inference_mode():
        fused = layer(x)
        monkeypatch.setattr(gguf_fused, "FUSED", False)  # diffusers' dequantizer, then .to()
        plain = layer(x)
    assert launches == [1]
    assert torch.equal(fused, plain)


def test_slot_codec_weights_unchanged_by_the_fused_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A block of mixed types: Q4_K and Q8_0 fused, Q5_1 through diffusers (with its constants
    # cached): the same bits in the slot with the kernels on and off.
    launches = counting_launches(monkeypatch)
    shapes = [("Q4_K", 256, 512), ("Q8_0", 128, 256), ("Q5_1", 64, 256), ("Q4_K", 64, 768)]
    datas = [quantized(qtype, rows, cols, seed).reshape(-1)
             for seed, (qtype, rows, cols) in enumerate(shapes)]
    runs, byte, value = [], 0, 0
    for (qtype, rows, cols), data in zip(shapes, datas, strict=True):
        quant = gguf_quant(gguf.GGMLQuantizationType[qtype])
        runs.append(GGUFRun(byte, data.numel(), quant, rows, cols, value))
        byte, value = byte + data.numel(), value + rows * cols + 64
    codec = GGUFCodec(tuple(runs), torch.bfloat16)
    staged = torch.cat(datas).cuda()

    def decoded() -> torch.Tensor:
        out = torch.zeros(codec.numel, dtype=torch.bfloat16, device="cuda")
        codec.bind(staged, out)()
        torch.cuda.synchronize()
        return out

    fused = decoded()
    assert launches == [1, 1]
    monkeypatch.setattr(gguf_fused, "FUSED", False)
    assert torch.equal(fused.view(torch.int16), decoded().view(torch.int16))
    assert launches == [1, 1]
