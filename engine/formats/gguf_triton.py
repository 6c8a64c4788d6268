"""The GPU dequantizers of GGUF Q8_0 and Q4_K blocks: one Triton kernel per type, a fixed
number of blocks per program.

Each kernel reads its blocks' bytes once (fp16 scales as two bytes each, so the blocks need no
alignment), computes in fp32 and rounds to fp16 after every step diffusers takes in fp16, then
converts to the output's dtype, all nearest-even: diffusers' dequantizer followed by
``.to(dtype)``, bit for bit (see ``gguf_fused``). One read of the blocks, one write of the
output; no intermediates in memory.

Launch contract: the ``dequantize_*_cuda`` functions allocate nothing, never sync the host and
run on the current CUDA stream. Called by ``gguf_fused.dequantize_into`` after its checks;
Triton is imported here only, so CPU-only installs never need it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Q8_0_BLOCKS_PER_PROGRAM = 64  # 2048 values: a 4 KiB bf16 tile per program
Q4_K_BLOCKS_PER_PROGRAM = 8  # 2048 values, as Q8_0's


@triton.jit
def _fp16_at(ptr, mask):
    """The fp16 stored little-endian in the two bytes at ``ptr``, as fp32 (exact)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.int32)
    # int32 -> int16 keeps the low 16 bits: the fp16's bit pattern.
    return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequantize_q8_0(blocks_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = block < n_blocks
    start = blocks_ptr + block * 34
    scale = _fp16_at(start, live)
    lane = tl.arange(0, 32)
    q = tl.load(start[:, None] + 2 + lane[None, :], mask=live[:, None], other=0)
    q = q.to(tl.int8, bitcast=True).to(tl.float32)
    # Exact in fp32; the fp16 rounding is diffusers' fp16 product, overflow to inf included.
    value = (scale[:, None] * q).to(tl.float16).to(tl.float32)
    tl.store(out_ptr + block[:, None] * 32 + lane[None, :], value.to(out_ptr.dtype.element_ty),
             mask=live[:, None])


@triton.jit
def _q4_k_scale_min(start, live, sub):
    """The 6-bit scales and mins (BLOCKS, 4) of sub-blocks ``sub`` (4,) of the blocks at
    ``start``: diffusers' ``get_scale_min`` over the 12 bytes at offset 4 (the same gathers as
    ``gguf_fused.q4_k_scale_min``)."""
    j = (sub % 4)[None, :]
    high = (sub >= 4)[None, :]
    mask = live[:, None]
    # Scales 0-3 and mins 0-3 are the low 6 bits of bytes 0-3 and 4-7; scales and mins 4-7
    # take their low 4 bits from bytes 8-11 (low, high nibble) and their top 2 bits from the
    # top 2 bits of bytes 0-3 and 4-7.
    sc_low = tl.load(start[:, None] + 4 + j, mask=mask, other=0).to(tl.int32)
    m_low = tl.load(start[:, None] + 8 + j, mask=mask, other=0).to(tl.int32)
    nibbles = tl.load(start[:, None] + 12 + j, mask=mask, other=0).to(tl.int32)
    sc = tl.where(high, (nibbles & 0x0F) | ((sc_low >> 6) << 4), sc_low & 0x3F)
    m = tl.where(high, (nibbles >> 4) | ((m_low >> 6) << 4), m_low & 0x3F)
    return sc, m


@triton.jit
def _q4_k_half(start, live, d, dmin, codes, out_row, HALF: tl.constexpr):
    """Write the sub-blocks ``2 * pair + HALF`` of the blocks at ``start``: code nibble
    ``HALF`` of each byte of ``codes`` (BLOCKS, 4 pairs, 32 lanes) into ``out_row`` (the
    blocks' first output element)."""
    pair = tl.arange(0, 4)
    sub = 2 * pair + HALF
    sc, m = _q4_k_scale_min(start, live, sub)  # (BLOCKS, 4)
    # fp16(d * sc) and fp16(dmin * m): exact fp32 products (11 by 6 bits), rounded.
    step = (d[:, None] * sc.to(tl.float32)).to(tl.float16).to(tl.float32)
    low = (dmin[:, None] * m.to(tl.float32)).to(tl.float16).to(tl.float32)
    q = ((codes >> (4 * HALF)) & 0x0F).to(tl.float32)  # (BLOCKS, 4, 32)
    # The fp16 rounding between the product and the difference keeps the two from fusing
    # into one fma: diffusers rounds the product to fp16 first.
    scaled = (step[:, :, None] * q).to(tl.float16).to(tl.float32)
    value = (scaled - low[:, :, None]).to(tl.float16).to(tl.float32)
    lane = tl.arange(0, 32)
    offset = sub[None, :, None] * 32 + lane[None, None, :]  # (1, 4, 32)
    tl.store(out_row[:, None, None] + offset, value.to(out_row.dtype.element_ty),
             mask=live[:, None, None])


@triton.jit
def _dequantize_q4_k(blocks_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = block < n_blocks
    start = blocks_ptr + block * 144
    d = _fp16_at(start, live)
    dmin = _fp16_at(start + 2, live)
    # The 128 code bytes once, as (BLOCKS, 4 pairs, 32 lanes): byte ``lane`` of pair ``p``
    # holds sub-block 2p's code ``lane`` (low nibble) and 2p+1's (high nibble).
    byte = tl.arange(0, 4)[:, None] * 32 + tl.arange(0, 32)[None, :]
    codes = tl.load(start[:, None, None] + 16 + byte[None, :, :], mask=live[:, None, None],
                    other=0).to(tl.int32)
    out_row = out_ptr + block * 256
    _q4_k_half(start, live, d, dmin, codes, out_row, HALF=0)
    _q4_k_half(start, live, d, dmin, codes, out_row, HALF=1)


def dequantize_q8_0_cuda(blocks: torch.Tensor, out: torch.Tensor, *, num_warps: int = 4) -> None:
    """Launch the dequantization of ``blocks`` (n, 34) uint8 into ``out`` (n * 32 values, both
    contiguous on one CUDA device; checked by ``gguf_fused.check``) on the current stream."""
    n = blocks.shape[0]
    grid = (triton.cdiv(n, Q8_0_BLOCKS_PER_PROGRAM),)
    _dequantize_q8_0[grid](blocks, out, n, BLOCKS=Q8_0_BLOCKS_PER_PROGRAM, num_warps=num_warps)


def dequantize_q4_k_cuda(blocks: torch.Tensor, out: torch.Tensor, *, num_warps: int = 4) -> None:
    """Launch the dequantization of ``blocks`` (n, 144) uint8 into ``out`` (n * 256 values,
    both contiguous on one CUDA device; checked by ``gguf_fused.check``) on the current
    stream."""
    n = blocks.shape[0]
    grid = (triton.cdiv(n, Q4_K_BLOCKS_PER_PROGRAM),)
    _dequantize_q4_k[grid](blocks, out, n, BLOCKS=Q4_K_BLOCKS_PER_PROGRAM, num_warps=num_warps)
