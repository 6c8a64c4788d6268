"""Flux under sequence parallelism: the hooks that shard its DiT and its Ulysses processor.

The root pre-hook splits the image and text tokens and their position ids (Flux computes
RoPE from the ids, so slicing them slices RoPE: rank r's ``[text_r, image_r]``); the
processor runs the double-stream (text + image) and single-stream attention on them.
Named by the family record (``engine.families.flux``); attached by
``engine.parallel.sharding.shard_dit``.
"""

from __future__ import annotations

from typing import Any

import torch

from ditserve.engine.parallel.joint_inputs import attach_joint_split
from ditserve.engine.parallel.processors import SequenceForward, UlyssesProcessor, refuse_mask


class FluxUlyssesProcessor(UlyssesProcessor):
    """Flux's double-stream (text + image) and single-stream attention."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> Any:
        from diffusers.models.embeddings import apply_rotary_emb

        refuse_mask(attention_mask)
        # (B, S_l, H*D) -> (B, S_l, H, D)
        heads = (-1, attn.head_dim)
        query = attn.norm_q(attn.to_q(hidden_states).unflatten(-1, heads))
        key = attn.norm_k(attn.to_k(hidden_states).unflatten(-1, heads))
        value = attn.to_v(hidden_states).unflatten(-1, heads)
        joint = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        if joint:
            assert encoder_hidden_states is not None
            text_query = attn.norm_added_q(attn.add_q_proj(encoder_hidden_states).unflatten(-1, heads))
            text_key = attn.norm_added_k(attn.add_k_proj(encoder_hidden_states).unflatten(-1, heads))
            text_value = attn.add_v_proj(encoder_hidden_states).unflatten(-1, heads)
            # This rank's joint sequence: [text_r, image_r], as diffusers' processor orders it.
            query = torch.cat([text_query, query], dim=1)
            key = torch.cat([text_key, key], dim=1)
            value = torch.cat([text_value, value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        out = self.attend(query, key, value)
        if not joint:
            return out  # single-stream blocks project the output themselves
        assert encoder_hidden_states is not None
        text_len = encoder_hidden_states.shape[1]
        text_out, image_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())


def attach(model: Any, forward: SequenceForward) -> None:
    """Hook the DiT ``model`` so its forward runs on this rank's tokens (``forward``)."""
    attach_joint_split(model, forward, FluxUlyssesProcessor(forward))
