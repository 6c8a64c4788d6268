"""The shared part of the families' attention processors under sequence parallelism.

A family's processor (in its ``*_sp`` module beside its step pipeline, e.g.
``engine.families.flux.sp``) is a diffusers attention processor (installed with
``set_attn_processor``; diffusers itself is not modified) that computes exactly what the
family's own processor computes - the same projections, QK norms and RoPE, on this rank's
tokens - and hands the attention to ``UlyssesProcessor.attend`` (``ulysses``), with the key
mask of the forward in flight (``SequenceForward``, filled by the family's hooks).

Joint-attention families (Flux, Qwen-Image) *split* their text tokens like image tokens,
each stream on its own (a rank's joint sequence is ``[text_r, image_r]``), so the text
stream's projections, norms and MLPs are not repeated on every rank and one all-to-all
carries both streams. (xDiT instead replicates the text and slices its heads per rank; at
512 text tokens next to 4096 image tokens the split saves ~11% of a step's work per extra
rank.) Cross-attention families (Wan) keep the text's K/V on every rank: an ordinary local
attention with no communication.

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

    Set by the DiT's root pre-hook (the family's hooks) before any block runs and cleared after the
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


def refuse_mask(attention_mask: torch.Tensor | None) -> None:
    if attention_mask is not None:
        raise ConfigError("an attention_mask passed to a sequence-parallel DiT is not supported: "
                          "the sharded forward builds the mask of its padded tokens itself")


class UlyssesProcessor:
    """The base of a family's processor: the forward it reads its key mask from, and the
    Ulysses attention (``attend``)."""

    # diffusers reads and writes these on every processor (set_attention_backend, parallelism).
    _attention_backend: Any = None
    _parallel_config: Any = None

    def __init__(self, forward: SequenceForward) -> None:
        self.forward = forward

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """(B, S_l, H, D) each -> (B, S_l, H * D) in the query's dtype."""
        out = ulysses_attention(query, key, value, self.forward.group,
                                key_mask=self.forward.key_mask, backend=self._attention_backend)
        return out.flatten(2, 3).to(query.dtype)
