"""Several MiniMax-H3 sequences in one DiT forward: their joint layout and their attention.

MiniMax-H3's DiT reads ONE packed sequence per request, ``[text | keyframes | audio |
video]`` rows (keyframe rows only in the ``fl2va`` workflow; ``ref2va`` puts its reference
blocks there) addressed by sequence-wide index
tensors, with a table of the distinct timesteps present
and each row's index into it; its batch axis only replicates that one layout. Here every
video of a step - requests with other prompts (other text lengths) and at other steps - is
one more item of the same packed sequence, in the layout the DiT's own forward already
handles::

    [text_1 audio_1 video_1 | text_2 audio_2 video_2 | ...]

Each item's layout is diffusers' own (``MiniMaxH3PrepareLayoutStep.build_packed_sequence``
and ``MiniMaxH3SetTimestepsStep.build_row_timesteps``), its indices offset by where the item
starts; the timestep tables are concatenated, each item's indices offset into its part. The
prompts' rows enter the forward as one text stream (every item's text, in item order), which
the DiT's token refiner attends over before scattering.

Everything in a block but attention is row-wise; only the attention must keep the items
apart: ``PackedItemsProcessor`` attends segment by segment - over each item's rows in the
blocks, over each item's text rows in the token refiner - reading the segments from a
context variable the pipeline sets around the forward (``items_in_flight``; a shape group's
forward runs in its own greenlet, which has its own context). One item is diffusers'
computation, op for op. Used by the step pipeline and the sequence-parallel processor.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ditserve.engine.pipelines.common import upload


@dataclass(frozen=True)
class ItemLayout:
    """One request's packed sequence (diffusers' layout), on the host: every video of the
    request has the same one.

    position_ids: (S, 3) float64 rotary coordinates; token_tags: (S,) modality tags;
    video_indices / audio_indices / text_indices: the rows of each modality;
    condition_rows: how many leading video rows are keyframe or reference conditioning
    (``fl2va``, ``ref2va``), held at their noise-augmentation level and never stepped;
    condition_audio_rows: how many leading audio rows are reference soundtracks (``ref2va``),
    held clean (``t = 1``) and never stepped.
    """

    position_ids: torch.Tensor
    token_tags: torch.Tensor
    video_indices: torch.Tensor
    audio_indices: torch.Tensor
    text_indices: torch.Tensor
    condition_rows: int = 0
    condition_audio_rows: int = 0

    @property
    def length(self) -> int:
        return int(self.position_ids.shape[0])

    @property
    def text_len(self) -> int:
        return int(self.text_indices.shape[0])


@dataclass(frozen=True)
class StepItem:
    """One video of this step's forward: its layout, its prompt's rows (1, L, D), its video
    rows (V, C * patch) and audio rows (A, C_a), the layout's conditioning rows first in
    each, and its two timesteps."""

    layout: ItemLayout
    text: torch.Tensor
    video: torch.Tensor
    audio: torch.Tensor
    video_timestep: float
    audio_timestep: float


def row_timesteps(layout: ItemLayout, video_t: float, audio_t: float,
                  keyframe_noise_aug: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct timesteps of one item's rows and each row's index into them, as
    diffusers' set-timesteps step plans them: keyframe and reference rows at
    ``max(t, noise_aug)``, reference soundtracks at 1."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    return MiniMaxH3SetTimestepsStep.build_row_timesteps(  # type: ignore[no-any-return]
        layout.video_indices, layout.audio_indices, layout.condition_rows,
        layout.condition_audio_rows, layout.text_len,
        video_t, audio_t,
        max(video_t, keyframe_noise_aug), 1.0)


def joint_inputs(items: Sequence[StepItem], *, keyframe_noise_aug: float,
                 device: torch.device) -> dict[str, Any]:
    """The DiT forward's keyword arguments for ``items`` in the joint layout (module doc):
    every input in the dtype diffusers passes it (float32 latent rows, the encoder's text
    states); the DiT casts each to its projection's dtype."""
    start, table = 0, 0
    positions, tags, video_idx, audio_idx, text_idx = [], [], [], [], []
    timesteps, timestep_idx = [], []
    for item in items:
        layout = item.layout
        unique, inverse = row_timesteps(layout, item.video_timestep, item.audio_timestep,
                                        keyframe_noise_aug)
        positions.append(layout.position_ids)
        tags.append(layout.token_tags)
        video_idx.append(layout.video_indices + start)
        audio_idx.append(layout.audio_indices + start)
        text_idx.append(layout.text_indices + start)
        timesteps.append(unique)
        timestep_idx.append(inverse + table)
        start += layout.length
        table += int(unique.shape[0])

    def up(parts: list[torch.Tensor]) -> torch.Tensor:
        return upload(torch.cat(parts), device)  # host-built: no host sync on CUDA

    return dict(
        hidden_states=torch.cat([item.video for item in items])[None],
        audio_hidden_states=torch.cat([item.audio for item in items])[None],
        encoder_hidden_states=torch.cat([item.text for item in items], dim=1),
        timestep=up(timesteps), timestep_indices=up(timestep_idx), token_tags=up(tags),
        position_ids=up(positions), video_indices=up(video_idx),
        audio_indices=up(audio_idx), text_indices=up(text_idx),
    )


# The items of the forward in flight: (text lengths, sequence lengths), item by item.
Segments = tuple[tuple[int, ...], tuple[int, ...]]
_SEGMENTS: contextvars.ContextVar[Segments | None] = contextvars.ContextVar(
    "minimax-h3-packed-items", default=None)
Stream = Literal["text", "items"]


@contextlib.contextmanager
def items_in_flight(items: Sequence[StepItem]) -> Iterator[None]:
    """Around one forward over ``items``: what its attention processors read."""
    token = _SEGMENTS.set((tuple(i.layout.text_len for i in items),
                           tuple(i.layout.length for i in items)))
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


def segments(stream: Stream, total: int) -> tuple[int, ...]:
    """The lengths of the ``stream``'s segments in the forward in flight; outside
    ``items_in_flight`` (a plain call of the DiT), one segment, as diffusers calls it."""
    current = _SEGMENTS.get()
    if current is None:
        return (total,)
    return current[0] if stream == "text" else current[1]


def project(attn: Any, hidden_states: torch.Tensor,
            rotary_emb: tuple[torch.Tensor, torch.Tensor] | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """diffusers' MiniMax-H3 processor before it attends: (B, S, H, D) queries, keys, values
    with their per-head norms and the rotary embedding."""
    from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb

    if attn.fused_projections:
        query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
    else:
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), \
            attn.to_v(hidden_states)
    query = attn.norm_q(query.unflatten(-1, (attn.heads, -1)))
    key = attn.norm_k(key.unflatten(-1, (attn.heads, -1)))
    value = value.unflatten(-1, (attn.heads, -1))
    if rotary_emb is not None:
        query, key = _apply_rotary_emb(query, *rotary_emb), _apply_rotary_emb(key, *rotary_emb)
    return query, key, value


def attend_segments(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    lengths: Sequence[int], *, backend: Any = None) -> torch.Tensor:
    """(B, S, H, D) each -> (B, S, H * D): each segment attends over itself only. Tokens past
    the segments (sequence-parallel padding) come out as zeros."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    if len(lengths) == 1 and lengths[0] == query.shape[1]:
        out = dispatch_attention_fn(query, key, value, dropout_p=0.0, is_causal=False,
                                    backend=backend)
        return out.flatten(2, 3)
    out = query.new_zeros(query.shape)
    begin = 0
    for length in lengths:
        part = slice(begin, begin + length)
        out[:, part] = dispatch_attention_fn(query[:, part], key[:, part], value[:, part],
                                             dropout_p=0.0, is_causal=False, backend=backend)
        begin += length
    return out.flatten(2, 3)


class PackedItemsProcessor:
    """MiniMax-H3's attention over the segments of a joint forward (module docstring):
    ``stream`` "text" in the token refiner, "items" in the blocks."""

    # diffusers reads and writes these on every processor (set_attention_backend, parallelism).
    _attention_backend: Any = None
    _parallel_config: Any = None

    def __init__(self, stream: Stream) -> None:
        self.stream: Stream = stream

    def __call__(self, attn: Any, hidden_states: torch.Tensor,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("MiniMax-H3's packed forward takes no attention_mask")
        query, key, value = project(attn, hidden_states, rotary_emb)
        lengths = segments(self.stream, int(hidden_states.shape[1]))
        out = attend_segments(query, key, value, lengths, backend=self._attention_backend)
        out = out.type_as(query)
        return attn.to_out[1](attn.to_out[0](out))  # type: ignore[no-any-return]


def install(model: Any) -> None:
    """The packed processors on every attention of the DiT ``model``."""
    model.set_attn_processor(PackedItemsProcessor("items"))
    for block in model.token_refiner.refiner_blocks:
        block.attn.set_processor(PackedItemsProcessor("text"))
