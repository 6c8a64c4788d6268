"""GGUF Q8_0 and Q4_K dequantization into a caller-owned tensor: one fused kernel per type on
CUDA, torch elsewhere.

Why it exists: diffusers' dequantizers run several memory-bound torch kernels with fp16
intermediates, then the caller's ``.to(compute_dtype)`` and, in the slot path, a ``copy_`` into
the slot. Under DLO that traffic kept a Flux Q8_0 step about 1.2x above its transfer floor and
a Q4_K step 3.6x (432.5 ms against 120.7 ms: Q4_K's dequantizer is many small kernels).
``gguf_triton``'s kernels read each block once and write the target dtype straight into ``out``.

The numbers are diffusers' bit for bit. Each of diffusers' fp16 operations gives what the
same operation in fp32, rounded to fp16 (nearest-even), gives: products of an fp16 and a small
integer are exact in fp32, and an fp32 difference of two fp16 values rounded to fp16 is the
correctly rounded difference (24 >= 2 * 11 + 2 bits: the double rounding is harmless). So the
kernels compute in fp32 and round to fp16 after every step diffusers takes in fp16, then
convert to the target dtype (nearest-even), as ``.to(dtype)`` does:

- Q8_0 (34 bytes: fp16 ``d``, 32 int8 ``q``): ``fp16(d * q)``;
- Q4_K (144 bytes: fp16 ``d`` and ``dmin``, 12 bytes of eight 6-bit sub-block scales ``sc``
  and mins ``m``, 128 bytes of 4-bit codes ``q``): ``fp16(fp16(fp16(d * sc) * q) -
  fp16(dmin * m))``.

The ``reference_*`` functions below do the kernels' steps in torch, with the kernels' indexing
(tests check them against diffusers bit for bit, and the kernels against them on CUDA).

Used by ``GGUFBlockLinear`` (compute-side dequantization, into a fresh tensor) and
``slot_codecs.GGUFCodec`` (into the slot's decoded region) where ``fused_type`` says so; other
types keep diffusers' functions. On CUDA the call allocates nothing, never syncs the host and
queues on the current stream. Triton is imported (``gguf_triton``) only on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ditserve.engine.errors import FormatError

DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})

# A switch for comparisons: the GPU tests turn it off to run diffusers' own dequantizers.
FUSED = True


@dataclass(frozen=True)
class FusedType:
    """A GGUF type with a fused dequantizer: its block geometry, its torch reference (blocks
    -> fp16 values, (n, values)) and the name of its launcher in ``gguf_triton``."""

    name: str
    block_bytes: int
    block_values: int
    reference: Callable[[torch.Tensor], torch.Tensor]
    kernel: str


def fused_type(quant_name: str, blocks: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``dequantize_into`` takes this call's place: blocks of a fused type on CUDA into
    a dtype it writes. Not while dynamo traces a block (``--compile``): inductor fuses
    diffusers' ops itself, so compiled blocks keep the graph they had."""
    return (FUSED and quant_name in TYPES and blocks.device.type == "cuda"
            and dtype in DTYPES and not torch.compiler.is_compiling())


def check(quant_name: str, blocks: torch.Tensor, out: torch.Tensor) -> FusedType:
    """The type's geometry; ``FormatError`` unless ``out`` can receive the values of
    ``blocks``."""
    kind = TYPES.get(quant_name)
    if kind is None:
        raise FormatError(f"no fused dequantizer for GGUF type {quant_name!r}; fused types: "
                          f"{', '.join(sorted(TYPES))}")
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != kind.block_bytes \
            or not blocks.is_contiguous():
        raise FormatError(f"{kind.name} blocks are a contiguous uint8 (n, {kind.block_bytes}) "
                          f"tensor, got {blocks.dtype} of shape {tuple(blocks.shape)}")
    if out.dtype not in DTYPES or not out.is_contiguous():
        raise FormatError(f"{kind.name} dequantization writes a contiguous bfloat16, float16 "
                          f"or float32 tensor, got {out.dtype}"
                          f"{'' if out.is_contiguous() else ' (non-contiguous)'}")
    if out.numel() != blocks.shape[0] * kind.block_values:
        raise FormatError(f"the target holds {out.numel()} values; {blocks.shape[0]} "
                          f"{kind.name} blocks hold {blocks.shape[0] * kind.block_values}")
    if out.device != blocks.device:
        raise FormatError(f"{kind.name} blocks are on {blocks.device} but the target is on "
                          f"{out.device}")
    return kind


def dequantize_into(quant_name: str, blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the values of ``blocks`` (n, block bytes) of GGUF type ``quant_name`` into ``out``
    (n * block values, any shape, in block order); returns ``out``."""
    kind = check(quant_name, blocks, out)
    if blocks.shape[0] == 0:
        return out
    if out.device.type == "cuda":
        from ditserve.engine.formats import gguf_triton

        getattr(gguf_triton, kind.kernel)(blocks, out)  # looked up per call: tests wrap it
    else:
        out.view(-1, kind.block_values).copy_(kind.reference(blocks))  # fp16 -> dtype: RNE
    return out


def reference_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """The fp16 values of Q8_0 ``blocks`` (n, 32) the kernel's way: exact fp32 product,
    rounded."""
    scale = blocks[:, :2].contiguous().view(torch.float16).float()  # (n, 1); any alignment
    values = blocks[:, 2:].view(torch.int8).float()
    return (scale * values).to(torch.float16)


def q4_k_scale_min(scales: torch.Tensor, sub: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scales and mins (n, len(sub)) of sub-blocks ``sub`` from the 12 packed bytes
    (n, 12, int32), as the kernel gathers them. Bytes 0-3 hold scales 0-3 (low 6 bits) and the
    top 2 bits of scales 4-7; bytes 4-7 the same for the mins; bytes 8-11 the low nibbles of
    scales 4-7 (low half) and of mins 4-7 (high half) - diffusers' ``get_scale_min``."""
    j, high = sub % 4, sub >= 4
    sc_low, m_low, nibbles = scales[:, j], scales[:, 4 + j], scales[:, 8 + j]
    sc = torch.where(high, (nibbles & 0x0F) | ((sc_low >> 6) << 4), sc_low & 0x3F)
    m = torch.where(high, (nibbles >> 4) | ((m_low >> 6) << 4), m_low & 0x3F)
    return sc, m


def reference_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """The fp16 values of Q4_K ``blocks`` (n, 256) the kernel's way: per byte of the codes,
    its low nibble for the even sub-block of a pair and its high nibble for the odd one."""
    n = blocks.shape[0]
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # (n, 1)
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    scales = blocks[:, 4:16].to(torch.int32)
    codes = blocks[:, 16:].to(torch.int32).view(n, 4, 32)  # (n, pair, lane)
    out = torch.empty(n, 4, 2, 32, dtype=torch.float16, device=blocks.device)
    pair = torch.arange(4, device=blocks.device)
    for half in (0, 1):  # sub-block 2 * pair + half
        sc, m = q4_k_scale_min(scales, 2 * pair + half)  # (n, 4)
        step = (d * sc).to(torch.float16).float()[:, :, None]  # (n, 4, 1)
        low = (dmin * m).to(torch.float16).float()[:, :, None]
        q = (codes >> (4 * half)) & 0x0F  # (n, 4, 32)
        out[:, :, half] = ((step * q).to(torch.float16).float() - low).to(torch.float16)
    return out.view(n, 256)  # (n, pair, half, lane) -> (n, sub-block * 32 + lane)


TYPES = {
    "Q8_0": FusedType("Q8_0", 34, 32, reference_q8_0, "dequantize_q8_0_cuda"),
    "Q4_K": FusedType("Q4_K", 144, 256, reference_q4_k, "dequantize_q4_k_cuda"),
}
