"""FLUX.2 under sequence parallelism: the hooks that shard its DiT and its Ulysses processor.

The root pre-hook splits the image tokens (the target's and any reference images', one
stream), the text tokens and their position ids (FLUX.2 computes RoPE from the ids, so
slicing them slices RoPE: rank r's ``[text_r, image_r]``, the order the blocks concatenate).
The modulations are per row, not per token, so they need no split. The processor runs the
double-stream (text + image) attention and the single-stream block's fused
attention + MLP on this rank's tokens, the attention itself over all ranks' keys (Ulysses).
Named by the family records (``engine.families.flux2``, ``flux2_klein``); attached by
``engine.parallel.sharding.shard_dit``.
"""

from __future__ import annotations

from typing import Any

import torch

from ditserve.engine.parallel.joint_inputs import attach_joint_split
from ditserve.engine.parallel.processors import SequenceForward, UlyssesProcessor, refuse_mask


class Flux2UlyssesProcessor(UlyssesProcessor):
    """FLUX.2's double-stream attention and single-stream parallel block."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> Any:
        if hasattr(attn, "to_qkv_mlp_proj"):
            # Flux2ParallelSelfAttention calls processor(attn, hidden, mask, rotary).
            return self._single(attn, hidden_states, encoder_hidden_states, attention_mask)
        return self._double(attn, hidden_states, encoder_hidden_states, attention_mask,
                            image_rotary_emb)

    def _rotate(self, query: torch.Tensor, key: torch.Tensor,
                rotary: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.embeddings import apply_rotary_emb

        if rotary is None:
            return query, key
        rotate: Any = apply_rotary_emb  # (cos, sin) in, one tensor out
        return (rotate(query, rotary, sequence_dim=1), rotate(key, rotary, sequence_dim=1))

    def _double(self, attn: Any, hidden_states: torch.Tensor,
                encoder_hidden_states: torch.Tensor | None,
                attention_mask: torch.Tensor | None, rotary: Any) -> Any:
        refuse_mask(attention_mask)
        heads = (-1, attn.head_dim)  # (B, S_l, H*D) -> (B, S_l, H, D)
        query = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, heads))
        key = attn.norm_k(attn.to_k(hidden_states).unflatten(-1, heads))
        value = attn.to_v(hidden_states).unflatten(-1, heads)
        assert encoder_hidden_states is not None  # FLUX.2's double blocks always have text
        text_query = attn.norm_added_q(attn.add_q_proj(encoder_hidden_states).unflatten(-1, heads))
        text_key = attn.norm_added_k(attn.add_k_proj(encoder_hidden_states).unflatten(-1, heads))
        text_value = attn.add_v_proj(encoder_hidden_states).unflatten(-1, heads)
        # This rank's joint sequence: [text_r, image_r], as diffusers' processor orders it.
        query, key = self._rotate(torch.cat([text_query, query], dim=1),
                                  torch.cat([text_key, key], dim=1), rotary)
        value = torch.cat([text_value, value], dim=1)
        out = self.attend(query, key, value)
        text_len = encoder_hidden_states.shape[1]
        text_out, image_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out))
        return image_out, attn.to_add_out(text_out)

    def _single(self, attn: Any, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None, rotary: Any) -> torch.Tensor:
        refuse_mask(attention_mask)
        # The fused projection: [q | k | v | MLP in], split as diffusers' processor does.
        fused = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim = 3 * attn.inner_dim
        qkv, mlp = fused.split_with_sizes([qkv_dim, fused.shape[-1] - qkv_dim], dim=-1)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
        query, key = self._rotate(attn.norm_q(query), attn.norm_k(key), rotary)
        out = self.attend(query, key, value)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


def attach(model: Any, forward: SequenceForward) -> None:
    """Hook the DiT ``model`` so its forward runs on this rank's tokens (``forward``)."""
    attach_joint_split(model, forward, Flux2UlyssesProcessor(forward))
