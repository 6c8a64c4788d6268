"""Token shards: which tokens of a sequence one SP rank holds, and which keys are real.

A sequence of ``total`` tokens split over ``parts`` ranks is padded at its end to the next
multiple of ``parts`` (zeros), and rank ``index`` holds the contiguous slice
``[index * local, (index + 1) * local)``. Padding is what lets any resolution (an odd latent
grid, a prompt of any length) run sequence-parallel; the padded tokens are masked as keys in
every attention (``key_mask``) and dropped when the output is gathered, so real tokens see
exactly the keys they would see unsharded. Only the last rank ever holds padding.

Flux and Qwen-Image attend over text and image tokens jointly: both streams are sharded on
their own, and rank r's local sequence is ``[text_r, image_r]`` (the order diffusers' blocks
concatenate them in). After Ulysses' all-to-all the keys are every rank's local sequence in
rank order, so the key mask is built in that order too. Keys' order does not change an
attention's result; only which keys are present does.

Used by ``sharding`` (hooks that split inputs and RoPE tables) and ``ulysses`` (gather).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenShard:
    """Rank ``index`` of ``parts``'s slice of a sequence of ``total`` tokens (see module doc)."""

    total: int
    parts: int
    index: int

    @property
    def padded(self) -> int:
        return -(-self.total // self.parts) * self.parts

    @property
    def local(self) -> int:
        return self.padded // self.parts

    @property
    def start(self) -> int:
        return self.index * self.local

    @property
    def needs_padding(self) -> bool:
        return self.padded != self.total

    def pad(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """``x`` with ``total`` entries along ``dim``, zero-padded to ``padded``."""
        if x.shape[dim] != self.total:
            raise ValueError(f"expected {self.total} tokens along dim {dim}, got {x.shape[dim]}")
        if not self.needs_padding:
            return x
        shape = list(x.shape)
        shape[dim] = self.padded - self.total
        return torch.cat([x, x.new_zeros(shape)], dim=dim)

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's tokens of the full ``x`` (padded first when needed)."""
        return self.pad(x, dim).narrow(dim, self.start, self.local)

    def valid(self, rows: int, device: torch.device,
              real: torch.Tensor | None = None) -> torch.Tensor:
        """(rows, padded) bool: True for real tokens (``real``: (rows, total) bool, e.g. a text
        mask of right-padded prompts; None: every token is real), False for the padding."""
        if real is None:
            positions = torch.arange(self.padded, device=device)
            return (positions < self.total).expand(rows, self.padded)
        return self.pad(real.to(device=device, dtype=torch.bool), dim=1)


def key_mask(
    streams: Sequence[tuple[TokenShard, torch.Tensor | None]], *, rows: int,
    device: torch.device,
) -> torch.Tensor | None:
    """The keys every rank's attention sees after the all-to-all, as a (rows, keys) bool mask
    in that order (rank by rank, each rank's streams in ``streams`` order); None when every
    key is real (no padding, no masked text), so attention keeps its unmasked fast path.

    streams: (shard, real) per stream of the joint sequence, in the order the blocks
    concatenate them (``real`` as in ``TokenShard.valid``)."""
    if all(not shard.needs_padding and real is None for shard, real in streams):
        return None
    parts = streams[0][0].parts
    # Per stream (rows, padded) -> (rows, parts, local): rank r's keys of that stream.
    per_rank = [shard.valid(rows, device, real).reshape(rows, parts, shard.local)
                for shard, real in streams]
    # (rows, parts, sum of locals) -> (rows, keys): rank 0's joint sequence, then rank 1's, ...
    return torch.cat(per_rank, dim=2).reshape(rows, -1)
