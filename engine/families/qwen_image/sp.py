"""Qwen-Image under sequence parallelism: the hooks that shard its DiT and its processor.

The root pre-hook splits the image and text tokens (the mask of right-padded prompts
joins the key mask); ``pos_embed`` computes RoPE for the whole text and the hooks slice
both tables to this rank's tokens; the processor runs the joint attention on them.
Named by the family record (``engine.families.qwen_image``); attached by
``engine.parallel.sharding.shard_dit``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ditserve.engine.errors import ConfigError
from ditserve.engine.parallel.processors import SequenceForward, UlyssesProcessor, refuse_mask
from ditserve.engine.parallel.sharding import token_input
from ditserve.engine.parallel.tokens import key_mask


class QwenImageUlyssesProcessor(UlyssesProcessor):
    """Qwen-Image's joint attention; the text mask arrives in the forward's key mask."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.transformers import transformer_qwenimage

        # diffusers annotates it as returning a tuple; with use_real=False it returns a tensor.
        rope: Any = transformer_qwenimage.apply_rotary_emb_qwen
        refuse_mask(attention_mask)
        if encoder_hidden_states is None:
            raise ConfigError("Qwen-Image's attention needs the text stream")
        heads = (-1, attn.inner_dim // attn.heads)  # (B, S_l, H*D) -> (B, S_l, H, D)

        def project(x: torch.Tensor, q: Any, k: Any, v: Any, norm_q: Any, norm_k: Any
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            query, key = q(x).unflatten(-1, heads), k(x).unflatten(-1, heads)
            if norm_q is not None:
                query = norm_q(query)
            if norm_k is not None:
                key = norm_k(key)
            return query, key, v(x).unflatten(-1, heads)

        img_q, img_k, img_v = project(hidden_states, attn.to_q, attn.to_k, attn.to_v,
                                      attn.norm_q, attn.norm_k)
        txt_q, txt_k, txt_v = project(encoder_hidden_states, attn.add_q_proj, attn.add_k_proj,
                                      attn.add_v_proj, attn.norm_added_q, attn.norm_added_k)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_q = rope(img_q, img_freqs, use_real=False)
            img_k = rope(img_k, img_freqs, use_real=False)
            txt_q = rope(txt_q, txt_freqs, use_real=False)
            txt_k = rope(txt_k, txt_freqs, use_real=False)
        # This rank's joint sequence: [text_r, image_r], as diffusers' processor orders it.
        out = self.attend(torch.cat([txt_q, img_q], dim=1), torch.cat([txt_k, img_k], dim=1),
                           torch.cat([txt_v, img_v], dim=1))
        text_len = encoder_hidden_states.shape[1]
        image_out = attn.to_out[0](out[:, text_len:].contiguous())
        if len(attn.to_out) > 1:
            image_out = attn.to_out[1](image_out)
        return image_out, attn.to_add_out(out[:, :text_len].contiguous())


def attach(model: Any, forward: SequenceForward) -> None:
    """Hook the DiT ``model`` so its forward runs on this rank's tokens (``forward``)."""
    sp = forward.group
    if getattr(model, "zero_cond_t", False):
        raise ConfigError("sequence parallelism does not support Qwen-Image DiTs with zero_cond_t "
                          "(image editing); run them with sequence_parallel_size 1")

    def split_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = token_input(kwargs, "hidden_states")  # (B, N, C)
        text = token_input(kwargs, "encoder_hidden_states")  # (B, T, D)
        text_mask = kwargs.get("encoder_hidden_states_mask")  # (B, T) or None
        image, txt = sp.shard(hidden.shape[1]), sp.shard(text.shape[1])
        kwargs.update(hidden_states=image.take(hidden, 1), encoder_hidden_states=txt.take(text, 1))
        if text_mask is not None:
            kwargs["encoder_hidden_states_mask"] = txt.take(text_mask.to(torch.bool), 1)
        mask = key_mask([(txt, text_mask), (image, None)], rows=hidden.shape[0],
                        device=hidden.device)
        forward.begin(output=image, key_mask=mask, image=image, text=txt)
        return args, kwargs

    def full_text_rope(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The DiT asks for RoPE of its (local) text length; ask for the whole text's, and
        # slice both tables to this rank's tokens below.
        kwargs["max_txt_seq_len"] = forward.extras["text"].total
        return args, kwargs

    def slice_rope(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        image_freqs, text_freqs = output  # (N, D/2), (T, D/2) complex
        return (forward.extras["image"].take(image_freqs, 0),
                forward.extras["text"].take(text_freqs, 0))

    model.register_forward_pre_hook(split_inputs, with_kwargs=True)
    model.pos_embed.register_forward_pre_hook(full_text_rope, with_kwargs=True)
    model.pos_embed.register_forward_hook(slice_rope, with_kwargs=True)
    model.set_attn_processor(QwenImageUlyssesProcessor(forward))
