"""Q4_K dequantization into a caller's tensor (``formats.gguf_fused``), CPU path: the torch
reference (the kernel's arithmetic and indexing) equals diffusers'
``dequantize_blocks_Q4_K(...).to(dtype)`` bit for bit - every 6-bit scale and min at every
sub-block position, every fp16 pattern of ``d`` and ``dmin`` (fp16 overflow, inf and nan
included), every code byte, and quantized weights; writes only its target; refuses what it
cannot fill, naming the problem (the kernel itself: ``test_gguf_q4_k_gpu.py``)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from diffusers.quantizers.gguf.utils import dequantize_blocks_Q4_K, get_scale_min
from formats.test_gguf_q8_0 import DTYPES, same_bits  # type: ignore[import-not-found]

from ditserve.engine.errors import FormatError
from ditserve.engine.formats.gguf_fused import (
    TYPES,
    dequantize_into,
    fused_type,
    q4_k_scale_min,
    reference_q4_k,
)
from ditserve.engine.formats.gguf_quant import quantize_q4_k

BLOCK_BYTES, BLOCK_VALUES = TYPES["Q4_K"].block_bytes, TYPES["Q4_K"].block_values


def pack_scales(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The 12 bytes (n, 12) of eight 6-bit scales and mins (n, 8) each: llama.cpp's packing,
    written out independently of the code under test."""
    packed = torch.empty(sc.shape[0], 12, dtype=torch.uint8)
    packed[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return packed


def every_combination() -> tuple[torch.Tensor, torch.Tensor]:
    """(4096, 8) scales and mins: at every sub-block position each of the 64 x 64 (scale, min)
    pairs once, and different pairs at different positions of a block (so a mixed-up position
    shows)."""
    k = torch.arange(4096)[:, None]
    j = torch.arange(8)[None, :]
    sc = (k // 64 + 9 * j) % 64
    m = (k % 64 + 23 * j) % 64
    return sc.to(torch.uint8), m.to(torch.uint8)


@functools.cache
def every_pattern() -> torch.Tensor:
    """(65536 + 4096, 144) blocks. First each fp16 bit pattern as ``d`` (negative, subnormal,
    inf and nan ones too), paired with another pattern as ``dmin``, each block with one of the
    scale-and-min combinations and code bytes 0-127 or 128-255 (every nibble in every
    sub-block). Then random blocks with finite scales."""
    patterns = torch.arange(1 << 16, dtype=torch.int32)
    d = patterns.to(torch.int16).view(torch.uint8).view(-1, 2)
    dmin = ((patterns * 40503 + 1) % (1 << 16)).to(torch.int16).view(torch.uint8).view(-1, 2)
    sc, m = every_combination()
    scales = pack_scales(sc, m).repeat(16, 1)
    codes = (torch.arange(128)[None, :] + 128 * (patterns[:, None] % 2)).to(torch.uint8)
    systematic = torch.cat([d, dmin, scales, codes], dim=1)
    g = torch.Generator().manual_seed(0)
    random = torch.randint(0, 256, (4096, BLOCK_BYTES), dtype=torch.uint8, generator=g)
    random[:, [1, 3]] &= 0xBF  # exponents below 16: finite d and dmin, either sign
    return torch.cat([systematic, random])


def diffusers_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return dequantize_blocks_Q4_K(blocks, BLOCK_VALUES, BLOCK_BYTES)


def test_scale_and_min_unpacking_equals_diffusers_for_every_combination() -> None:
    sc, m = every_combination()
    scales = pack_scales(sc, m)
    want_sc, want_m = get_scale_min(scales)
    assert torch.equal(want_sc, sc) and torch.equal(want_m, m)  # the test's packing is right
    got_sc, got_m = q4_k_scale_min(scales.to(torch.int32), torch.arange(8))
    assert torch.equal(got_sc, sc.to(torch.int32)) and torch.equal(got_m, m.to(torch.int32))
    # Any sub-block order, as the kernel asks for them (even ones, then odd ones).
    odd = torch.tensor([1, 3, 5, 7])
    got_sc, got_m = q4_k_scale_min(scales.to(torch.int32), odd)
    assert torch.equal(got_sc, sc[:, odd].to(torch.int32))
    assert torch.equal(got_m, m[:, odd].to(torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_path_equals_diffusers_for_every_scale_pattern(dtype: torch.dtype) -> None:
    blocks = every_pattern()
    diffusers = diffusers_q4_k(blocks)
    assert diffusers.dtype == torch.float16  # what the fused path must reproduce, then cast
    assert same_bits(reference_q4_k(blocks), diffusers)
    out = torch.empty(blocks.shape[0] * BLOCK_VALUES, dtype=dtype)
    got = dequantize_into("Q4_K", blocks, out).view(-1, BLOCK_VALUES)
    assert same_bits(got, diffusers.to(dtype))


def test_the_patterns_reach_the_edges() -> None:
    blocks = every_pattern()
    diffusers = diffusers_q4_k(blocks)
    scales = blocks[:, :4].contiguous().view(torch.float16)  # (n, 2): d, dmin
    finite = torch.isfinite(scales).all(dim=1)
    inside = diffusers[finite]
    # Finite d and dmin whose products overflow fp16 (to inf, and inf - inf to nan), fp16
    # subnormal values, negative zeros, negative scales.
    assert torch.isinf(inside).any() and torch.isnan(inside).any()
    assert ((inside != 0) & (inside.abs() < 2.0**-14) & inside.isfinite()).any()
    assert (inside == 0).logical_and(torch.signbit(inside)).any()
    assert (scales[finite] < 0).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_weights_equal_diffusers_and_stay_finite(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(1)
    weights = (rng.standard_normal((96, 1024)) * 0.05).astype(np.float32)
    weights[0] *= 1e4  # large and small blocks: d and dmin over a wide fp16 range
    weights[1] *= 1e-4
    blocks = torch.from_numpy(quantize_q4_k(weights)).view(-1, BLOCK_BYTES)
    want = diffusers_q4_k(blocks).to(dtype)
    got = dequantize_into("Q4_K", blocks, torch.empty(96, 1024, dtype=dtype))
    assert torch.isfinite(want).all()
    assert same_bits(got.view(-1, BLOCK_VALUES), want)


def test_writes_only_its_target_from_unaligned_blocks() -> None:
    blocks = every_pattern()[-37:]  # random, finite scales
    raw = torch.zeros(1 + blocks.numel(), dtype=torch.uint8)
    raw[1:] = blocks.reshape(-1)
    unaligned = raw[1:].view(-1, BLOCK_BYTES)  # starts at an odd byte
    slot = torch.zeros(37 * BLOCK_VALUES + 300, dtype=torch.bfloat16)
    target = slot[100 : 100 + 37 * BLOCK_VALUES].view(37, BLOCK_VALUES)
    dequantize_into("Q4_K", unaligned, target)
    want = diffusers_q4_k(blocks).to(torch.bfloat16)
    assert same_bits(target, want)
    assert not slot[:100].any() and not slot[100 + 37 * BLOCK_VALUES :].any()


def test_refuses_what_it_cannot_fill_naming_the_problem() -> None:
    blocks = torch.zeros(4, BLOCK_BYTES, dtype=torch.uint8)
    with pytest.raises(FormatError, match="holds 100 values; 4 Q4_K blocks hold 1024"):
        dequantize_into("Q4_K", blocks, torch.empty(100, dtype=torch.bfloat16))
    with pytest.raises(FormatError, match="float64"):
        dequantize_into("Q4_K", blocks, torch.empty(1024, dtype=torch.float64))
    with pytest.raises(FormatError, match="non-contiguous"):
        dequantize_into("Q4_K", blocks, torch.empty(2048, dtype=torch.bfloat16)[::2])
    with pytest.raises(FormatError, match=r"Q4_K blocks are a contiguous uint8 \(n, 144\)"):
        dequantize_into("Q4_K", blocks.view(-1, 72), torch.empty(1024, dtype=torch.bfloat16))
    with pytest.raises(FormatError, match=r"\(n, 144\)"):  # Q8_0's blocks are not Q4_K's
        dequantize_into("Q4_K", torch.zeros(4, 34, dtype=torch.uint8),
                        torch.empty(128, dtype=torch.bfloat16))
    with pytest.raises(FormatError, match="no fused dequantizer for GGUF type 'Q6_K'"):
        dequantize_into("Q6_K", torch.zeros(4, 210, dtype=torch.uint8),
                        torch.empty(1024, dtype=torch.bfloat16))
    empty = torch.empty(0, dtype=torch.bfloat16)
    assert dequantize_into("Q4_K", blocks[:0], empty) is empty


def test_which_calls_are_fused() -> None:
    # The CPU path above is the reference; layers and codecs on CPU call diffusers as before,
    # and types without a kernel never take the fused path.
    blocks = torch.zeros(2, BLOCK_BYTES, dtype=torch.uint8)
    assert not fused_type("Q4_K", blocks, torch.bfloat16)
    assert not fused_type("Q6_K", blocks, torch.bfloat16)
    assert set(TYPES) == {"Q8_0", "Q4_K"}
