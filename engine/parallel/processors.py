"""The families' attention processors under sequence parallelism.

Each is a diffusers attention processor (installed with ``set_attn_processor``; diffusers
itself is not modified) that computes exactly what the family's own processor computes -
the same projections, QK norms and RoPE, on this rank's tokens - and hands the attention to
``ulysses.ulysses_attention``, with the key mask of the forward in flight (``SequenceForward``,
filled by ``sharding``'s hooks). What each does with text:

- Flux and Qwen-Image (joint attention): text tokens are *split* like image tokens, each
  stream on its own (a rank's joint sequence is ``[text_r, image_r]``), so the text stream's
  projections, norms and MLPs are not repeated on every rank and one all-to-all carries both
  streams. (xDiT instead replicates the text and slices its heads per rank; at 512 text
  tokens next to 4096 image tokens the split saves ~11% of a step's work per extra rank.)
  Qwen-Image's mask of right-padded prompts joins the padding mask.
- Wan self attention: split, all-to-all. Wan cross attention to the text: the text's K/V are
  replicated on every rank and the queries are this rank's tokens, so it is an ordinary local
  attention with no communication at all (every query attends over the full text).

A user-given ``attention_mask`` is refused: the sharded forward owns the mask.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any

import torch

from ditserve.engine.errors import ConfigError
from ditserve.engine.parallel.tokens import TokenShard
from ditserve.engine.parallel.ulysses import SequenceGroup, ulysses_attention


@dataclass(frozen=True)
class _ForwardState:
    key_mask: torch.Tensor | None
    output: TokenShard | None
    extras: dict[str, Any]


_NO_FORWARD = _ForwardState(None, None, {})


class SequenceForward:
    """The shard layout of the DiT forward running now on this rank.

    Set by the DiT's root pre-hook (``sharding``) before any block runs and cleared after the
    forward; read by the processors (``key_mask``) and the output gather (``output``). The
    layout lives in a context variable, not on the object: a multi-shape step runs each shape
    group's forward in its own greenlet, interleaved at block boundaries (engine/block_major),
    and every greenlet has its own context, so each forward reads its own layout.
    """

    def __init__(self, group: SequenceGroup) -> None:
        self.group = group
        self._state: contextvars.ContextVar[_ForwardState] = contextvars.ContextVar(
            f"ditserve-sequence-forward-{id(self)}", default=_NO_FORWARD)

    @property
    def key_mask(self) -> torch.Tensor | None:
        return self._state.get().key_mask

    @property
    def output(self) -> TokenShard | None:  # the stream the DiT's proj_out emits (image tokens)
        return self._state.get().output

    @property
    def extras(self) -> dict[str, Any]:
        return self._state.get().extras

    def begin(self, *, output: TokenShard, key_mask: torch.Tensor | None, **extras: Any) -> None:
        self._state.set(_ForwardState(key_mask, output, extras))

    def end(self) -> None:
        self._state.set(_NO_FORWARD)


def _refuse_mask(attention_mask: torch.Tensor | None) -> None:
    if attention_mask is not None:
        raise ConfigError("an attention_mask passed to a sequence-parallel DiT is not supported: "
                          "the sharded forward builds the mask of its padded tokens itself")


class _UlyssesProcessor:
    # diffusers reads and writes these on every processor (set_attention_backend, parallelism).
    _attention_backend: Any = None
    _parallel_config: Any = None

    def __init__(self, forward: SequenceForward) -> None:
        self.forward = forward

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """(B, S_l, H, D) each -> (B, S_l, H * D) in the query's dtype."""
        out = ulysses_attention(query, key, value, self.forward.group,
                                key_mask=self.forward.key_mask, backend=self._attention_backend)
        return out.flatten(2, 3).to(query.dtype)


class FluxUlyssesProcessor(_UlyssesProcessor):
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

        _refuse_mask(attention_mask)
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
        out = self._attend(query, key, value)
        if not joint:
            return out  # single-stream blocks project the output themselves
        assert encoder_hidden_states is not None
        text_len = encoder_hidden_states.shape[1]
        text_out, image_out = out.split_with_sizes([text_len, out.shape[1] - text_len], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())


class QwenImageUlyssesProcessor(_UlyssesProcessor):
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
        _refuse_mask(attention_mask)
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
        out = self._attend(torch.cat([txt_q, img_q], dim=1), torch.cat([txt_k, img_k], dim=1),
                           torch.cat([txt_v, img_v], dim=1))
        text_len = encoder_hidden_states.shape[1]
        image_out = attn.to_out[0](out[:, text_len:].contiguous())
        if len(attn.to_out) > 1:
            image_out = attn.to_out[1](image_out)
        return image_out, attn.to_add_out(out[:, :text_len].contiguous())


def _wan_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Wan's rotary embedding on interleaved pairs, as its own processor applies it.
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class WanUlyssesProcessor(_UlyssesProcessor):
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

        _refuse_mask(attention_mask)
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
            out = self._attend(query, key, value)
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
