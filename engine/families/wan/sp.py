"""Wan under sequence parallelism: the hooks that shard its DiT and its processor.

Wan's tokens first exist inside the forward (its patch embedding): the root pre-hook
plans the shards, the first block's pre-hook slices the tokens and a hook on ``rope``
slices the RoPE tables. Self attention is split (all-to-all); cross attention to the
text keeps the text's K/V on every rank and this rank's queries: an ordinary local
attention with no communication (every query attends over the full text).
Named by the family record (``engine.families.wan``); attached by
``engine.parallel.sharding.shard_dit``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ditserve.engine.parallel.processors import SequenceForward, UlyssesProcessor, refuse_mask
from ditserve.engine.parallel.sharding import token_input
from ditserve.engine.parallel.tokens import key_mask


def _wan_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Wan's rotary embedding on interleaved pairs, as its own processor applies it.
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class WanUlyssesProcessor(UlyssesProcessor):
    """Wan's self attention (Ulysses) and cross attention to the text (local, see module doc)."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        refuse_mask(attention_mask)
        image_context = None
        if attn.add_k_proj is not None and encoder_hidden_states is not None:
            # Image-to-video: image tokens lead the context; 512 text tokens follow (diffusers).
            split = encoder_hidden_states.shape[1] - 512
            image_context = encoder_hidden_states[:, :split]
            encoder_hidden_states = encoder_hidden_states[:, split:]
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(context)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(context).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = _wan_rope(query, *rotary_emb), _wan_rope(key, *rotary_emb)
        if encoder_hidden_states is None:
            out = self.attend(query, key, value)
        else:
            # Cross attention: this rank's queries over the whole (replicated) text.
            out = dispatch_attention_fn(query, key, value, backend=self._attention_backend)
            out = out.flatten(2, 3).type_as(query)
        if image_context is not None:
            image_key = attn.norm_added_k(attn.add_k_proj(image_context)).unflatten(2, (attn.heads, -1))
            image_value = attn.add_v_proj(image_context).unflatten(2, (attn.heads, -1))
            image_out = dispatch_attention_fn(query, image_key, image_value,
                                              backend=self._attention_backend)
            out = out + image_out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def attach(model: Any, forward: SequenceForward) -> None:
    """Hook the DiT ``model`` so its forward runs on this rank's tokens (``forward``)."""
    sp = forward.group
    patch = tuple(int(p) for p in model.config.patch_size)  # (t, h, w)

    def plan_shards(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        latents = token_input(kwargs, "hidden_states")  # (B, C, F, H, W)
        _, _, frames, height, width = latents.shape
        tokens = (frames // patch[0]) * (height // patch[1]) * (width // patch[2])
        image = sp.shard(tokens)
        timestep = kwargs.get("timestep")
        if isinstance(timestep, torch.Tensor) and timestep.ndim == 2:
            # Wan 2.2 TI2V: a timestep per token (rows, tokens), embedded per token.
            kwargs["timestep"] = image.take(timestep, 1)
        forward.begin(output=image, key_mask=key_mask([(image, None)], rows=latents.shape[0],
                                                      device=latents.device))
        return args, kwargs

    def split_tokens(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # The first block's input is the first place Wan's tokens exist: (B, N, C).
        assert forward.output is not None, "the root pre-hook plans the shards"
        if args:
            return (forward.output.take(args[0], 1), *args[1:]), kwargs
        kwargs["hidden_states"] = forward.output.take(kwargs["hidden_states"], 1)
        return args, kwargs

    def slice_rope(module: nn.Module, args: Any, output: Any) -> Any:
        assert forward.output is not None
        cos, sin = output  # (1, N, 1, D) each
        return forward.output.take(cos, 1), forward.output.take(sin, 1)

    model.register_forward_pre_hook(plan_shards, with_kwargs=True)
    model.blocks[0].register_forward_pre_hook(split_tokens, with_kwargs=True)
    model.rope.register_forward_hook(slice_rope)
    model.set_attn_processor(WanUlyssesProcessor(forward))
