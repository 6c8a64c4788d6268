"""Cosmos3 decoder layers whose token-wise parts run a slice of tokens at a time.

A step's joint sequence at 720p is ~88k generated tokens (two CFG sequences of 48 x 23 x 40
patches). diffusers' decoder layer runs each pathway's feed-forward over the whole sequence:
its gate and up projections and their product are three tensors of the MLP width (12288 in
Nano, 25600 in the Super-sized DiT: 2.2 / 4.5 GB each in bf16), the largest of the layer and
what sets a streamed model's peak HBM. The feed-forward mixes no tokens, so here it runs over
slices of ``chunk_tokens`` tokens into one preallocated output: equal within rounding (its
matmuls see fewer rows per call), and the peak becomes attention's working set, which grows
with the model's width, not its MLP's.

The RMS norms are sliced the same way: diffusers' ``RMSNorm`` upcasts its input to float32
twice over (the upcast, its square) and scales in float32, so over the whole sequence it
holds two float32 copies of it - of the queries (64 heads x 128 in the Super-sized DiT,
2.7 GiB each at 88k tokens) the layer's largest tensors. Each token's (each head's) norm
reads that token only, so slice by slice it is bit-identical.

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

# Tokens per slice: 8192 x 25600 (the Super-sized MLP) x 2 bytes = 400 MiB per intermediate
# (three alive at once); a slice's matmuls stay large enough to run at full rate.
DEFAULT_CHUNK_TOKENS = 8192


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


# Token-wise modules of a decoder layer (paths from the layer): the two feed-forwards, the
# four pre-norms, and the per-head query/key norms of both pathways.
TOKEN_WISE = ("mlp", "mlp_moe_gen", "input_layernorm", "input_layernorm_moe_gen",
              "post_attention_layernorm", "post_attention_layernorm_moe_gen",
              "self_attn.norm_q", "self_attn.norm_k", "self_attn.norm_added_q",
              "self_attn.norm_added_k", "self_attn.k_norm_und_for_gen")


def chunk_token_math(model: Any, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
    """Run every layer's feed-forwards and RMS norms over slices of ``chunk_tokens`` tokens."""
    for layer in model.layers:
        for path in TOKEN_WISE:
            module = layer
            for name in path.split("."):
                module = getattr(module, name, None)
            if not isinstance(module, nn.Module) or isinstance(module, nn.Identity):
                continue  # absent in this config (e.g. no prompt-key norm for the gen path)
            if hasattr(module.forward, "__wrapped__"):
                continue  # installed already
            module.forward = _sliced_forward(module, module.forward, chunk_tokens)
