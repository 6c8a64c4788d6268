"""Several Cosmos3 sequences in one DiT forward: their joint layout and their attention.

Cosmos3's DiT takes one *packed* sequence, no batch axis: a prompt's tokens (the causal
"understanding" pathway, ``und_len`` long) followed by its generated tokens (vision latents
in patches, then sound latents; the "generation" pathway, which attends to the prompt and to
itself). diffusers' pipeline calls it once per sequence (the prompt, then the negative
prompt). Here every sequence of a step - each request's prompt and negative prompt, requests
at any step - runs in one forward, in the layout the DiT's own forward already handles: all
prompts' tokens first, then all generated tokens, item by item::

    [und_1 und_2 ... und_k | gen_1 gen_2 ... gen_k]     und_len = sum of the prompts' tokens

Everything in a decoder layer but attention is token-wise, and the DiT's forward takes lists
of vision/sound items already; only the attention must keep the items apart. Its processor
(``PackedItemsProcessor``) reads the items' lengths from a context variable the pipeline sets
around the forward (``items_in_flight``; each shape group's forward runs in its own
greenlet, which has its own context) and attends item by item exactly as diffusers' processor
attends the one item it sees: the prompt causally, the generated tokens over ``[prompt_i,
gen_i]``. One item is diffusers' computation, op for op.

``ItemLayout`` is one sequence's static part (built once per request at encode, with
diffusers' own segment builders); ``joint_inputs`` lays a step's items out as the DiT's
forward arguments. Used by the step pipeline and the sequence-parallel processor.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ItemLayout:
    """One sequence (a prompt with its generated tokens) of a request, on the device.

    input_ids: (und_len,) the prompt's token ids (on the host: the token table is there);
    und_positions / gen_positions: (3, und_len) / (3, gen_len) mRoPE position ids;
    vision_grid: the patch grid (T, h, w); noisy_frames: (f,) latent frames denoised (all but
    an image-to-video's first); noisy_vision: (f * h * w,) the noisy vision tokens' positions
    within the generated tokens; sound_len: sound tokens after the vision tokens (0: none).
    """

    input_ids: torch.Tensor
    und_positions: torch.Tensor
    gen_positions: torch.Tensor
    vision_grid: tuple[int, int, int]
    noisy_frames: torch.Tensor
    noisy_vision: torch.Tensor
    sound_len: int

    @property
    def und_len(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_vision(self) -> int:
        t, h, w = self.vision_grid
        return t * h * w

    @property
    def gen_len(self) -> int:
        return self.num_vision + self.sound_len

    @property
    def num_noisy_vision(self) -> int:
        return int(self.noisy_vision.shape[0])


@dataclass(frozen=True)
class StepItem:
    """One sequence of this step's forward: its layout, the latents it denoises (vision
    (1, C, T, H, W); sound (C_s, T_s) or None) and its timestep."""

    layout: ItemLayout
    vision: torch.Tensor
    sound: torch.Tensor | None
    timestep: float


def joint_inputs(items: Sequence[StepItem], *, dtype: torch.dtype,
                 device: torch.device) -> dict[str, Any]:
    """The DiT forward's keyword arguments for ``items`` in the joint layout (module doc)."""
    und_len = sum(item.layout.und_len for item in items)
    gen_start = und_len
    vision_index, vision_mse, vision_t = [], [], []
    sound_index, sound_t, sound_tokens, sound_shapes, sound_noisy = [], [], [], [], []
    for item in items:
        layout = item.layout
        vision_index.append(torch.arange(gen_start, gen_start + layout.num_vision,
                                         device=device))
        vision_mse.append(layout.noisy_vision + gen_start)
        # As diffusers: a float32 timestep per noisy token, written from a host float.
        vision_t.append(torch.full((layout.num_noisy_vision,), item.timestep, device=device))
        if item.sound is not None:
            start = gen_start + layout.num_vision
            sound_index.append(torch.arange(start, start + layout.sound_len, device=device))
            sound_t.append(torch.full((layout.sound_len,), item.timestep, device=device))
            sound_tokens.append(item.sound.to(dtype))
            sound_shapes.append((layout.sound_len, 1, 1))
            sound_noisy.append(torch.arange(layout.sound_len, device=device))
        gen_start += layout.gen_len
    positions = [item.layout.und_positions for item in items]
    positions += [item.layout.gen_positions for item in items]
    kwargs: dict[str, Any] = dict(
        input_ids=torch.cat([item.layout.input_ids for item in items]),
        text_indexes=torch.arange(und_len, device=device),
        position_ids=torch.cat(positions, dim=1),
        und_len=und_len, sequence_length=gen_start,
        vision_tokens=[item.vision.to(dtype) for item in items],
        vision_token_shapes=[item.layout.vision_grid for item in items],
        vision_sequence_indexes=torch.cat(vision_index),
        vision_mse_loss_indexes=torch.cat(vision_mse),
        vision_timesteps=torch.cat(vision_t),
        vision_noisy_frame_indexes=[item.layout.noisy_frames for item in items],
    )
    if sound_tokens:
        indexes = torch.cat(sound_index)
        kwargs.update(sound_tokens=sound_tokens, sound_token_shapes=sound_shapes,
                      sound_sequence_indexes=indexes, sound_mse_loss_indexes=indexes,
                      sound_timesteps=torch.cat(sound_t), sound_noisy_frame_indexes=sound_noisy)
    return kwargs


# The items of the forward in flight: (prompt lengths, generated lengths), item by item.
Segments = tuple[tuple[int, ...], tuple[int, ...]]
_SEGMENTS: contextvars.ContextVar[Segments | None] = contextvars.ContextVar(
    "cosmos3-packed-items", default=None)


@contextlib.contextmanager
def items_in_flight(items: Sequence[StepItem]) -> Iterator[None]:
    """Around one forward over ``items``: what its attention processors read."""
    token = _SEGMENTS.set((tuple(i.layout.und_len for i in items),
                           tuple(i.layout.gen_len for i in items)))
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


def segments(und_total: int, gen_total: int) -> Segments:
    """The items of the forward in flight; outside ``items_in_flight`` (a plain call of the
    DiT), one item of the whole sequence, as diffusers' pipeline calls it."""
    current = _SEGMENTS.get()
    return ((und_total,), (gen_total,)) if current is None else current


ROPE_CHUNK_TOKENS = 16384  # tokens per slice of the rotary embedding's temporaries


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class Projected:
    """One layer's queries, keys and values of both pathways, (tokens, heads, head_dim), with
    RoPE applied; ``key_und_for_gen``: the prompt's keys as the generated tokens see them."""

    query_und: torch.Tensor
    key_und: torch.Tensor
    key_und_for_gen: torch.Tensor
    value_und: torch.Tensor
    query_gen: torch.Tensor
    key_gen: torch.Tensor
    value_gen: torch.Tensor


def project(attn: Any, und: torch.Tensor, gen: torch.Tensor,
            rotary_emb: tuple[torch.Tensor, ...]) -> Projected:
    """What diffusers' Cosmos3 processor computes before attending: per-pathway projections,
    per-head norms (the generated tokens may see the prompt's keys through their own norm)
    and the rotary embedding of each pathway's positions."""
    heads, kv_heads, dim = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
    q_und = attn.norm_q(attn.to_q(und).view(-1, heads, dim))
    k_und = attn.norm_k(attn.to_k(und).view(-1, kv_heads, dim))
    v_und = attn.to_v(und).view(-1, kv_heads, dim)
    k_und_gen = k_und if attn.k_norm_und_for_gen is None else attn.k_norm_und_for_gen(k_und)
    q_gen = attn.norm_added_q(attn.add_q_proj(gen).view(-1, heads, dim))
    k_gen = attn.norm_added_k(attn.add_k_proj(gen).view(-1, kv_heads, dim))
    v_gen = attn.add_v_proj(gen).view(-1, kv_heads, dim)
    cos_und, sin_und, cos_gen, sin_gen = (t.unsqueeze(1) for t in rotary_emb)

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= ROPE_CHUNK_TOKENS:
            return x * cos + _rotate_half(x) * sin
        # Elementwise, so sliced over tokens into one output: the same values, with one
        # slice's temporaries instead of three whole-sequence ones (``block`` module doc).
        out = torch.empty_like(x)
        for start in range(0, x.shape[0], ROPE_CHUNK_TOKENS):
            part = slice(start, start + ROPE_CHUNK_TOKENS)
            out[part] = x[part] * cos[part] + _rotate_half(x[part]) * sin[part]
        return out

    return Projected(rope(q_und, cos_und, sin_und), rope(k_und, cos_und, sin_und),
                     rope(k_und_gen, cos_und, sin_und), v_und,
                     rope(q_gen, cos_gen, sin_gen), rope(k_gen, cos_gen, sin_gen), v_gen)


def attend_items(p: Projected, items: Segments, *, backend: Any = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each item's attention, as diffusers' processor attends one: (tokens, heads, dim) in,
    (tokens, heads * dim) out for each pathway. Tokens past the items' (sequence-parallel
    padding) come out as zeros."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        out = dispatch_attention_fn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                    is_causal=causal, enable_gqa=True, backend=backend)
        return out.squeeze(0)

    und_out = p.query_und.new_zeros(p.query_und.shape)
    gen_out = p.query_gen.new_zeros(p.query_gen.shape)
    u0 = g0 = 0
    for u, g in zip(*items, strict=True):
        u1, g1 = u0 + u, g0 + g
        und_out[u0:u1] = attend(p.query_und[u0:u1], p.key_und[u0:u1], p.value_und[u0:u1],
                                True)
        # The generated tokens see their prompt's keys (through their own norm) and their own.
        keys = torch.cat([p.key_und_for_gen[u0:u1], p.key_gen[g0:g1]])
        values = torch.cat([p.value_und[u0:u1], p.value_gen[g0:g1]])
        gen_out[g0:g1] = attend(p.query_gen[g0:g1], keys, values, False)
        u0, g0 = u1, g1
    return und_out.flatten(-2, -1), gen_out.flatten(-2, -1)


class PackedItemsProcessor:
    """Cosmos3's attention over the items of a joint forward (module docstring)."""

    # diffusers reads and writes these on every processor (set_attention_backend, parallelism).
    _attention_backend: Any = None
    _parallel_config: Any = None

    def __call__(self, attn: Any, und_seq: torch.Tensor, gen_seq: torch.Tensor,
                 rotary_emb: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        p = project(attn, und_seq, gen_seq, rotary_emb)
        und, gen = attend_items(p, segments(und_seq.shape[0], gen_seq.shape[0]),
                                backend=self._attention_backend)
        return attn.to_out(und), attn.to_add_out(gen)
