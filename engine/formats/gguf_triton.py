"""The GPU dequantizer of GGUF Q8_0 blocks: one Triton kernel, ``BLOCKS`` blocks per program.

Each program reads its blocks' fp16 scales (two bytes each, so the blocks need no alignment)
and int8 values, multiplies in fp32 (exact), rounds to fp16 and converts to the output's dtype,
both nearest-even: diffusers' ``d * x`` in fp16 followed by ``.to(dtype)``, bit for bit (see
``gguf_q8_0``). One read of the 34-byte blocks, one write of the output; no intermediates.

Launch contract: ``dequantize_q8_0_cuda`` allocates nothing, never syncs the host and runs on
the current CUDA stream. Called by ``gguf_q8_0.dequantize_q8_0_into`` after its checks; Triton
is imported here only, so CPU-only installs never need it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCKS_PER_PROGRAM = 64  # 2048 values: a 4 KiB bf16 tile per program


@triton.jit
def _dequantize_q8_0(blocks_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    block = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = block < n_blocks
    start = blocks_ptr + block * 34
    lo = tl.load(start, mask=live, other=0).to(tl.int32)
    hi = tl.load(start + 1, mask=live, other=0).to(tl.int32)
    # int32 -> int16 keeps the low 16 bits: the fp16 scale's bit pattern.
    scale = (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    lane = tl.arange(0, 32)
    q = tl.load(start[:, None] + 2 + lane[None, :], mask=live[:, None], other=0)
    q = q.to(tl.int8, bitcast=True).to(tl.float32)
    # Exact in fp32; the fp16 rounding is diffusers' fp16 product, overflow to inf included.
    value = (scale[:, None] * q).to(tl.float16).to(tl.float32)
    tl.store(out_ptr + block[:, None] * 32 + lane[None, :], value.to(out_ptr.dtype.element_ty),
             mask=live[:, None])


def dequantize_q8_0_cuda(blocks: torch.Tensor, out: torch.Tensor, *, num_warps: int = 4) -> None:
    """Launch the dequantization of ``blocks`` (n, 34) uint8 into ``out`` (n * 32 values, both
    contiguous on one CUDA device; checked by ``gguf_q8_0.check``) on the current stream."""
    n = blocks.shape[0]
    grid = (triton.cdiv(n, BLOCKS_PER_PROGRAM),)
    _dequantize_q8_0[grid](blocks, out, n, BLOCKS=BLOCKS_PER_PROGRAM, num_warps=num_warps)
