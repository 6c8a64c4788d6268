"""Q8_0 dequantization into a caller's tensor (``formats.gguf_fused``), CPU path: diffusers'
``dequantize_blocks_Q8_0(...).to(dtype)`` bit for bit over every fp16 scale pattern and every
int8 value; writes only its target; refuses targets it cannot fill; on CPU the layers keep
diffusers' functions (the kernel itself: ``test_gguf_q8_0_gpu.py``; Q4_K:
``test_gguf_q4_k.py``)."""

from __future__ import annotations

import functools

import pytest
import torch
from diffusers.quantizers.gguf.utils import dequantize_blocks_Q8_0

from ditserve.engine.errors import FormatError
from ditserve.engine.formats.gguf_fused import TYPES, dequantize_into, fused_type

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BLOCK_BYTES, BLOCK_VALUES = TYPES["Q8_0"].block_bytes, TYPES["Q8_0"].block_values


@functools.cache
def every_pattern() -> torch.Tensor:
    """(65536 * 8, 34) blocks: each fp16 scale bit pattern (negative, subnormal, inf and nan
    ones too) with the 256 int8 values spread over 8 blocks."""
    scales = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.uint8)
    values = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).view(torch.uint8)
    blocks = torch.empty(1 << 16, 8, BLOCK_BYTES, dtype=torch.uint8)
    blocks[:, :, :2] = scales.view(-1, 1, 2)
    blocks[:, :, 2:] = values.view(8, BLOCK_VALUES)
    return blocks.view(-1, BLOCK_BYTES)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit patterns, except that a NaN need only be a NaN (payloads are not compared)."""
    nan = torch.isnan(want)
    if not torch.equal(torch.isnan(got), nan):
        return False
    ints = {2: torch.int16, 4: torch.int32}[want.element_size()]
    return torch.equal(got[~nan].view(ints), want[~nan].view(ints))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_path_equals_diffusers_for_every_scale_and_value(dtype: torch.dtype) -> None:
    blocks = every_pattern()
    diffusers = dequantize_blocks_Q8_0(blocks, BLOCK_VALUES, BLOCK_BYTES)
    assert diffusers.dtype == torch.float16  # what the fused path must reproduce, then cast
    want = diffusers.to(dtype)
    out = torch.empty(blocks.shape[0] * BLOCK_VALUES, dtype=dtype)
    got = dequantize_into("Q8_0", blocks, out).view(-1, BLOCK_VALUES)
    assert same_bits(got, want)
    # The edges are in there: finite scales whose products overflow fp16, fp16 subnormal
    # products, -128 with negative scales.
    finite = torch.isfinite(blocks[:, :2].contiguous().view(torch.float16)).expand_as(diffusers)
    assert torch.isinf(diffusers[finite]).any()
    assert ((diffusers != 0) & (diffusers.abs() < 2.0**-14)).any()


def test_writes_only_its_target_from_unaligned_blocks() -> None:
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (1 + 37 * BLOCK_BYTES,), dtype=torch.uint8, generator=g)
    raw[1::BLOCK_BYTES] = torch.randint(0, 256, (37,), dtype=torch.uint8, generator=g)
    raw[2::BLOCK_BYTES] = 0x1C  # scale exponents: keep the random scales finite
    blocks = raw[1:].view(-1, BLOCK_BYTES)  # starts at an odd byte
    slot = torch.zeros(37 * BLOCK_VALUES + 300, dtype=torch.bfloat16)
    target = slot[100 : 100 + 37 * BLOCK_VALUES].view(37, BLOCK_VALUES)
    dequantize_into("Q8_0", blocks, target)
    want = dequantize_blocks_Q8_0(blocks.clone(), BLOCK_VALUES, BLOCK_BYTES).to(torch.bfloat16)
    assert torch.equal(target.view(torch.int16), want.view(torch.int16))
    assert not slot[:100].any() and not slot[100 + 37 * BLOCK_VALUES :].any()


def test_refuses_targets_it_cannot_fill() -> None:
    blocks = torch.zeros(4, BLOCK_BYTES, dtype=torch.uint8)
    with pytest.raises(FormatError, match="holds 100 values"):
        dequantize_into("Q8_0", blocks, torch.empty(100, dtype=torch.bfloat16))
    with pytest.raises(FormatError, match="float64"):
        dequantize_into("Q8_0", blocks, torch.empty(128, dtype=torch.float64))
    with pytest.raises(FormatError, match="non-contiguous"):
        dequantize_into("Q8_0", blocks, torch.empty(256, dtype=torch.bfloat16)[::2])
    with pytest.raises(FormatError, match=r"\(n, 34\)"):
        dequantize_into("Q8_0", blocks.view(-1, 17), torch.empty(128, dtype=torch.bfloat16))
    empty = torch.empty(0, dtype=torch.bfloat16)
    assert dequantize_into("Q8_0", blocks[:0], empty) is empty


def test_cpu_keeps_diffusers_functions() -> None:
    # The CPU path above is the reference; layers and codecs on CPU call diffusers as before.
    assert not fused_type("Q8_0", torch.zeros(2, BLOCK_BYTES, dtype=torch.uint8), torch.bfloat16)
