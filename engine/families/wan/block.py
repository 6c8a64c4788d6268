"""Wan blocks whose token-wise float32 math runs a slice of tokens at a time.

diffusers' ``WanTransformerBlock`` computes its norms, AdaLN modulation and gated residual
adds in float32 over the whole sequence: every such line holds two or three float32 copies
of the hidden states (each twice a bf16 one) beside the bf16 input, the sub-layer's output
and the norm's output. At video token counts that, not the weights, sets a streamed model's
peak HBM (bench/activation_peak.py: about 11 bf16 hidden states at once). None of that math
mixes tokens - each token's norm and modulation are its own - so this forward computes it
over slices of ``chunk_rows`` row-tokens into preallocated bf16 outputs; every element gets
the same float32 operations in the same order, so that part is bit-identical to diffusers'
forward. The feed-forward is token-wise as well and its 13824-wide intermediate is the
block's largest tensor, so it runs over slices too (``ffn_chunk_rows``; equal within
rounding, since its matmuls see fewer rows per call). Self- and cross-attention run on the
whole sequence exactly as diffusers calls them, and the peak becomes self-attention's own
working set (q/k/v).

``chunk_token_math(dit)`` installs it on every block of the family's DiT whose
block forward still has diffusers' signature; it leaves hooks (offload, sequence parallel,
shape groups) untouched, since they run around ``forward``.
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

# Row-tokens per slice: 16384 x 5120 (Wan 14B width) x 4 bytes = 320 MiB per float32 temporary.
DEFAULT_CHUNK_ROWS = 16384
BLOCK_PARAMETERS = ("self", "hidden_states", "encoder_hidden_states", "temb", "rotary_emb")


def token_slices(rows: int, tokens: int, chunk_rows: int) -> Iterator[slice]:
    """Slices of the token axis holding about ``chunk_rows`` row-tokens each (all rows)."""
    step = max(1, chunk_rows // max(1, rows))
    for start in range(0, tokens, step):
        yield slice(start, min(tokens, start + step))


def _per_token(t: torch.Tensor, tokens: slice) -> torch.Tensor:
    """A modulation's slice: per-token ones (B, N, D) are sliced, shared ones (B, 1, D) not."""
    return t[:, tokens] if t.shape[1] != 1 else t


def _modulation(block: Any, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The six AdaLN tensors as diffusers' block computes them, each (B, 1 or N, D) float32."""
    if temb.ndim == 4:  # Wan 2.2 TI2V: (B, N, 6, D), a timestep per token
        parts = (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        return tuple(p.squeeze(2) for p in parts)
    return (block.scale_shift_table + temb.float()).chunk(6, dim=1)  # (B, 6, D)


def _sliced(out: torch.Tensor, slices: list[slice], fn: Callable[[slice], torch.Tensor]) -> torch.Tensor:
    """``out`` with ``out[:, s] = fn(s)`` for every slice: one slice's temporaries at a time."""
    for tokens in slices:
        out[:, tokens] = fn(tokens)
    return out


def _modulated_norm(norm: nn.Module, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                    slices: list[slice]) -> torch.Tensor:
    """``(norm(x.float()) * (1 + scale) + shift).type_as(x)``, a slice at a time."""
    return _sliced(torch.empty_like(x), slices, lambda s: (
        norm(x[:, s].float()) * (1 + _per_token(scale, s)) + _per_token(shift, s)).type_as(x))


def _gated_residual(x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor,
                    slices: list[slice]) -> torch.Tensor:
    """``(x.float() + update.float() * gate).type_as(x)``, a slice at a time (diffusers'
    self-attention residual multiplies the bf16 update by the float32 gate directly: the
    same float32 product)."""
    return _sliced(torch.empty_like(x), slices, lambda s: (
        x[:, s].float() + update[:, s].float() * _per_token(gate, s)).type_as(x))


def _feed_forward(ffn: nn.Module, x: torch.Tensor, chunk_rows: int | None) -> torch.Tensor:
    """``ffn(x)``, over slices of ``chunk_rows`` row-tokens unless None: the feed-forward is
    token-wise too, and its 13824-wide intermediate is the block's largest tensor."""
    if chunk_rows is None:
        return ffn(x)
    rows, tokens = x.shape[:2]
    return _sliced(torch.empty_like(x), list(token_slices(rows, tokens, chunk_rows)),
                   lambda s: ffn(x[:, s]))


def chunked_block_forward(
    self: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor, rotary_emb: torch.Tensor,
) -> torch.Tensor:
    """``WanTransformerBlock.forward`` with its token-wise float32 math in slices (``self``:
    a diffusers ``WanTransformerBlock``, its sub-modules read as attributes)."""
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = _modulation(self, temb)
    rows, tokens = hidden_states.shape[:2]
    slices = list(token_slices(rows, tokens, self.chunk_rows))

    # 1. Self-attention, gated residual.
    normed = _modulated_norm(self.norm1, hidden_states, scale_msa, shift_msa, slices)
    update = self.attn1(normed, None, None, rotary_emb)
    del normed
    x = _gated_residual(hidden_states, update, gate_msa, slices)
    del update

    # 2. Cross-attention, plain residual (bf16, as diffusers).
    normed = _sliced(torch.empty_like(x), slices, lambda s: self.norm2(x[:, s].float()).type_as(x))
    update = self.attn2(normed, encoder_hidden_states, None, None)
    del normed
    x = x + update
    del update

    # 3. Feed-forward, gated residual.
    normed = _modulated_norm(self.norm3, x, c_scale_msa, c_shift_msa, slices)
    update = _feed_forward(self.ffn, normed, self.ffn_chunk_rows)
    del normed
    return _gated_residual(x, update, c_gate_msa, slices)


def chunk_token_math(dit: nn.Module, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                     ffn_chunk_rows: int | None = DEFAULT_CHUNK_ROWS) -> int:
    """Install ``chunked_block_forward`` on ``dit.blocks``; returns how many blocks took it.

    ``ffn_chunk_rows`` also runs the feed-forward over slices of that many row-tokens (None:
    on the whole sequence, as diffusers). Its matmuls then see fewer rows per call, which a
    BLAS may reduce in another order, so outputs are equal to diffusers' within rounding,
    not bit for bit; every engine configuration (resident, DLO, SP) runs the same forward.

    A block class whose forward no longer has diffusers' parameters (a diffusers release
    changed it) keeps its own forward, with a warning: the sliced copy would be stale.
    """
    blocks = getattr(dit, "blocks", None)
    if blocks is None:
        return 0
    installed = 0
    for block in blocks:
        params = tuple(inspect.signature(type(block).forward).parameters)
        if params != BLOCK_PARAMETERS or not hasattr(block, "scale_shift_table"):
            log.warning("%s.forward%s is not the layout ditserve slices; its float32 math "
                        "stays whole-sequence", type(block).__name__, params)
            return installed
        block.chunk_rows = chunk_rows
        block.ffn_chunk_rows = ffn_chunk_rows
        block.forward = types.MethodType(chunked_block_forward, block)
        installed += 1
    return installed
