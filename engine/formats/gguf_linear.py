"""``GGUFBlockLinear``: a linear layer whose weight stays in its GGUF blocks (Q8_0, Q4_K, ...)
and is dequantized on the device it runs on, at each call.

diffusers' ``GGUFLinear`` keeps the blocks in a ``GGUFParameter`` (a ``Parameter`` subclass
carrying the quant type). Layer offload plans flat slabs from plain tensors and repoints them
into slots by ``param.data = view``, so - as with ``FP8Linear`` (``formats.fp8_linear``) - the
blocks are held here as a plain uint8 buffer ``weight_q`` (rows, bytes per row) and the quant
type as an attribute: offload streams the stored bytes with the block (Q8_0 about 0.53x,
Q4_K about 0.28x of bf16's), and the dequantization is the compute's first step on the device
- or, with ``--dlo-dequant slot``, the offload's decode stream dequantizes the bytes into a bf16
slot region (``formats.slot_codecs.GGUFCodec``) and points ``decoded_weight`` at it, and the
layer runs a plain linear over it.

The numbers are diffusers': the same per-type torch dequantization (``dequantize_functions``,
plain torch ops, so they run on CPU and CUDA alike), then ``weight.to(compute_dtype)`` and
``F.linear``, as ``GGUFLinear.forward_native`` - so a DiT of these layers equals diffusers' own
GGUF loading of the same file. Q8_0 and Q4_K on CUDA go through ``gguf_fused``'s kernels
instead (diffusers' numbers bit for bit, in one pass over the blocks).

Built by ``weights.dit_file`` from a GGUF-loaded DiT (with diffusers' dequantizer for the
type: this leaf package imports neither diffusers nor gguf); run inside the DiT's blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ditserve.engine.formats.gguf_fused import dequantize_into, fused_type

# (blocks (n, type_size) uint8, block_size, type_size) -> values (n, block_size)
BlockDequantizer = Callable[[torch.Tensor, int, int], torch.Tensor]


@dataclass(frozen=True)
class GGUFQuant:
    """One GGUF tensor type: its name and id, its block geometry (values and bytes per block)
    and the torch function that dequantizes its blocks (the caller's: diffusers'; this leaf
    package imports no loader)."""

    name: str
    type_id: int
    block_size: int
    type_size: int
    dequantize: BlockDequantizer


class GGUFBlockLinear(nn.Module):
    """Drop-in for ``nn.Linear`` at inference over GGUF-quantized weight bytes."""

    weight_q: torch.Tensor
    # Set by slot dequantization (``offload.slot_dequant``) while the block is streamed: the
    # weight already dequantized into a slot, in the compute dtype. Not a registered buffer:
    # it is no stored tensor (state dicts, layouts and slabs never see it).
    decoded_weight: torch.Tensor | None = None

    def __init__(self, in_features: int, out_features: int, *, weight_q: torch.Tensor,
                 quant: GGUFQuant, bias: nn.Parameter | None,
                 compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.quant = quant
        self.compute_dtype = compute_dtype
        self.register_buffer("weight_q", weight_q)
        self.bias = bias

    def dequantized_weight(self) -> torch.Tensor:
        """The (out, in) weight these bytes stand for, in the dequantizer's float dtype."""
        q = self.quant
        # (rows, bytes) -> (blocks, bytes per block) -> values -> (rows, in_features)
        blocks = self.weight_q.reshape(-1, q.type_size)
        return q.dequantize(blocks, q.block_size, q.type_size).reshape(
            self.out_features, self.in_features)

    def compute_weight(self) -> torch.Tensor:
        """The (out, in) weight in the compute dtype: diffusers' dequantizer then a cast, or
        for Q8_0 and Q4_K on CUDA the fused kernel writing the compute dtype at once (same
        bits)."""
        q = self.quant
        blocks = self.weight_q.reshape(-1, q.type_size)
        if fused_type(q.name, blocks, self.compute_dtype):
            out = torch.empty(self.out_features, self.in_features, dtype=self.compute_dtype,
                              device=blocks.device)
            return dequantize_into(q.name, blocks, out)
        return self.dequantized_weight().to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.decoded_weight
        if weight is None:
            weight = self.compute_weight()
        bias = self.bias.to(self.compute_dtype) if self.bias is not None else None
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"quant={self.quant.name}")
