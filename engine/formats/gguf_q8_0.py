"""GGUF Q8_0 dequantization into a caller-owned tensor: one fused kernel on CUDA, torch elsewhere.

Why it exists: diffusers' Q8_0 dequantizer (``d.view(float16) * x.view(int8)``, then the
caller's ``.to(compute_dtype)``, and in the slot path a ``copy_`` into the slot) runs several
memory-bound kernels with fp16 and bf16 intermediates. Under DLO that traffic kept a Flux Q8_0
step about 1.2x above its transfer floor. ``gguf_triton``'s kernel reads each 34-byte block
(fp16 scale, 32 int8) once and writes the target dtype straight into ``out``.

The numbers are diffusers' bit for bit: the fp32 product of the fp16 scale and the int8 value
is exact (11-bit by 8-bit significands), rounding it to fp16 (nearest-even) gives what the
fp16 multiply gives, and that fp16 is then converted to the target dtype (nearest-even), as
``.to(dtype)`` does. The CPU path below does the same steps in torch (tests check it against
diffusers over every scale pattern and every int8 value).

Used by ``GGUFBlockLinear`` (compute-side dequantization, into a fresh tensor) and
``slot_codecs.GGUFCodec`` (into the slot's decoded region) where ``fused_q8_0`` says so; other
types keep diffusers' functions. On CUDA the call allocates nothing, never syncs the host and
queues on the current stream. Triton is imported (``gguf_triton``) only on CUDA.
"""

from __future__ import annotations

import torch

from ditserve.engine.errors import FormatError

BLOCK_BYTES = 34  # fp16 scale + 32 int8 values
BLOCK_VALUES = 32
DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})

# A switch for comparisons: the GPU tests turn it off to run diffusers' own dequantizer.
FUSED = True


def fused_q8_0(quant_name: str, blocks: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``dequantize_q8_0_into`` takes this call's place: Q8_0 blocks on CUDA into a
    dtype it writes. Not while dynamo traces a block (``--compile``): inductor fuses diffusers'
    ops itself, so compiled blocks keep the graph they had."""
    return (FUSED and quant_name == "Q8_0" and blocks.device.type == "cuda"
            and dtype in DTYPES and not torch.compiler.is_compiling())


def check(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Raise ``FormatError`` unless ``out`` can receive the values of ``blocks``."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != BLOCK_BYTES \
            or not blocks.is_contiguous():
        raise FormatError(f"Q8_0 blocks are a contiguous uint8 (n, {BLOCK_BYTES}) tensor, got "
                          f"{blocks.dtype} of shape {tuple(blocks.shape)}")
    if out.dtype not in DTYPES or not out.is_contiguous():
        raise FormatError(f"Q8_0 dequantization writes a contiguous bfloat16, float16 or "
                          f"float32 tensor, got {out.dtype}"
                          f"{'' if out.is_contiguous() else ' (non-contiguous)'}")
    if out.numel() != blocks.shape[0] * BLOCK_VALUES:
        raise FormatError(f"the target holds {out.numel()} values; {blocks.shape[0]} Q8_0 "
                          f"blocks hold {blocks.shape[0] * BLOCK_VALUES}")
    if out.device != blocks.device:
        raise FormatError(f"Q8_0 blocks are on {blocks.device} but the target is on "
                          f"{out.device}")


def dequantize_q8_0_into(blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the values of ``blocks`` (n, 34) into ``out`` (n * 32 values, any shape, in
    block order); returns ``out``."""
    check(blocks, out)
    if blocks.shape[0] == 0:
        return out
    if out.device.type == "cuda":
        from ditserve.engine.formats.gguf_triton import dequantize_q8_0_cuda

        dequantize_q8_0_cuda(blocks, out)
    else:
        out.view(-1, BLOCK_VALUES).copy_(reference_fp16(blocks))  # fp16 -> dtype: nearest-even
    return out


def reference_fp16(blocks: torch.Tensor) -> torch.Tensor:
    """The fp16 values of ``blocks`` (n, 32) the kernel's way: exact fp32 product, rounded."""
    scale = blocks[:, :2].contiguous().view(torch.float16).float()  # (n, 1); any alignment
    values = blocks[:, 2:].view(torch.int8).float()
    return (scale * values).to(torch.float16)
