"""Cosmos3 decoder layers whose token-wise parts run a slice of tokens at a time.

A step's joint sequence at 720p is ~88k generated tokens (two CFG sequences of 48 x 23 x 40
patches). diffusers' decoder layer runs each pathway's feed-forward over the whole sequence:
its gate and up projections and their product are three tensors of the MLP width (12288 in
Nano, 25600 in the Super-sized DiT: 2.2 / 4.5 GB each in bf16), the largest of the layer and
what sets a streamed model's peak HBM. The feed-forward mixes no tokens, so here it runs over
slices of ``chunk_tokens`` tokens into one preallocated output: equal within rounding (its
matmuls see fewer rows per call), and the peak becomes attention's working set, which grows
with the model's width, not its MLP's.

The rotary embedding of the queries and keys is sliced the same way (``packing.project``):
elementwise, so bit-identical.

``chunk_token_math(dit)`` installs it on every layer; it leaves the hooks around the layers
(offload, sequence parallel, shape groups, step cache) untouched, since they run around
the layers' ``forward``. Used by the step pipeline and the offload benchmark.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Tokens per slice: 16384 x 25600 (the Super-sized MLP) x 2 bytes = 800 MiB per intermediate.
DEFAULT_CHUNK_TOKENS = 16384


def _sliced_forward(mlp: nn.Module, inner: Callable[[torch.Tensor], torch.Tensor],
                    chunk_tokens: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        tokens = int(x.shape[0])
        if tokens <= chunk_tokens:
            return inner(x)
        first = inner(x[:chunk_tokens])
        # (tokens, hidden) in, (tokens, hidden) out: each slice's rows written in place.
        out = first.new_empty((tokens, *first.shape[1:]))
        out[:chunk_tokens] = first
        for start in range(chunk_tokens, tokens, chunk_tokens):
            out[start:start + chunk_tokens] = inner(x[start:start + chunk_tokens])
        return out

    forward.__wrapped__ = inner  # type: ignore[attr-defined]
    return forward


def chunk_token_math(model: Any, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
    """Run every layer's two feed-forwards over slices of ``chunk_tokens`` tokens."""
    for layer in model.layers:
        for name in ("mlp", "mlp_moe_gen"):
            mlp = getattr(layer, name)
            if hasattr(mlp.forward, "__wrapped__"):
                continue  # installed already
            mlp.forward = _sliced_forward(mlp, mlp.forward, chunk_tokens)
