"""Ulysses attention: sequence shards in, sequence shards out, full-sequence attention inside.

Every SP rank holds ``S_l`` tokens of each attention's query, key and value, for all ``H``
heads. One all-to-all turns them into all ``P * S_l`` tokens for ``H / P`` heads (rank j gets
head group j), each rank runs ordinary attention over the whole sequence for its heads, and
a second all-to-all turns the result back into this rank's tokens for every head (DeepSpeed-
Ulysses). Communication per attention: 4 tensors of the local activations' size, no matter
how many ranks, and attention's math is untouched - which is why every family's processor
can call the same ``ulysses_attention``. Limits, as in xDiT / yunchang and vLLM-Omni: the head
count must divide by the SP size (``ParallelConfig``'s rules refuse it otherwise); sequence
lengths need not (``tokens`` pads and masks).

The collectives are torch's functional collectives (traceable, so ``--compile`` compiles a
block with its all-to-alls in the graph); on CPU they run over gloo, on GPUs over NCCL on
the SP group's own communicator (``rendezvous`` keeps it apart from DLO's weight group, so
a block's all-to-all never queues behind the next block's weight gather).

Called by the attention processors (``processors``) and the output gather hook (``sharding``);
a family whose attention is not one plain attention per row (Cosmos3: causal prompt
attention and several packed sequences) calls ``sequence_to_heads`` / ``heads_to_sequence``
around its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ditserve.engine.errors import ConfigError
from ditserve.engine.parallel.tokens import TokenShard


@dataclass(frozen=True)
class SequenceGroup:
    """The SP process group this rank belongs to: ``size`` ranks, this one ``rank``."""

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    size: int

    @classmethod
    def of(cls, group: Any) -> SequenceGroup:
        return cls(group, int(dist.get_rank(group)), int(dist.get_world_size(group)))

    def shard(self, total: int) -> TokenShard:
        """This rank's slice of a sequence of ``total`` tokens."""
        return TokenShard(total, self.size, self.rank)


def check_heads(heads: int, size: int, *, what: str) -> None:
    if heads % size:
        raise ConfigError(
            f"{what} has {heads} attention heads, which do not divide by "
            f"sequence_parallel_size={size}: Ulysses gives every rank heads/size heads; pick a "
            "sequence_parallel_size that divides the head count"
        )


def _waited(result: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for: eagerly funcol hands back a lazy
    AsyncCollectiveTensor whose views (our reshapes) would not wait themselves; under
    tracing it returns a tensor with the wait already in the graph."""
    if isinstance(result, funcol.AsyncCollectiveTensor):
        return result.wait()
    return result


def sequence_to_heads(tensors: tuple[torch.Tensor, ...], sp: SequenceGroup) -> torch.Tensor:
    """n tensors (B, S_l, H, D) -> one (n, B, P*S_l, H/P, D): every token, this rank's heads."""
    stacked = torch.stack(tensors)
    n, b, s, h, d = stacked.shape
    p = sp.size
    # (n, B, S_l, H, D) -> (P, S_l, n, B, H/P, D): block j of dim 0 is head group j, for rank j.
    send = stacked.reshape(n, b, s, p, h // p, d).permute(3, 2, 0, 1, 4, 5).contiguous()
    received = _waited(funcol.all_to_all_single(send, None, None, sp.group))
    # block j now holds rank j's S_l tokens: (P, S_l, n, B, H/P, D) -> (n, B, P*S_l, H/P, D)
    return received.reshape(p * s, n, b, h // p, d).permute(1, 2, 0, 3, 4)


def heads_to_sequence(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """(B, P*S_l, H/P, D) -> (B, S_l, H, D): this rank's tokens, every head."""
    b, total, hl, d = x.shape
    p = sp.size
    s = total // p
    # (B, P*S_l, H/P, D) -> (P, S_l, B, H/P, D): block j is rank j's tokens.
    send = x.reshape(b, p, s, hl, d).permute(1, 2, 0, 3, 4).contiguous()
    received = _waited(funcol.all_to_all_single(send, None, None, sp.group))
    # block j now holds head group j of this rank's tokens: -> (B, S_l, P * H/P, D)
    return received.permute(2, 1, 0, 3, 4).reshape(b, s, p * hl, d)


def ulysses_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sp: SequenceGroup,
    *,
    key_mask: torch.Tensor | None = None,
    backend: Any = None,
) -> torch.Tensor:
    """Attention of this rank's queries over every rank's keys; (B, S_l, H, D) each, out too.

    key_mask: (B, P*S_l) bool over the gathered keys (``tokens.key_mask``), True = attend;
    None attends to every key. backend: the processor's diffusers attention backend (None:
    the active one, torch SDPA by default)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    check_heads(int(query.shape[2]), sp.size, what="this attention")
    q, k, v = sequence_to_heads((query, key, value), sp).unbind(0)
    # (B, keys) -> (B, 1, 1, keys): broadcast over heads and queries.
    mask = None if key_mask is None else key_mask[:, None, None, :]
    out = dispatch_attention_fn(q, k, v, attn_mask=mask, backend=backend)
    return heads_to_sequence(out.to(query.dtype), sp)


def gather_tokens(x: torch.Tensor, shard: TokenShard, sp: SequenceGroup, *, dim: int = 1
                  ) -> torch.Tensor:
    """Every rank's tokens of ``x`` (this rank's ``shard.local`` along ``dim``), in order,
    without the padding: the full sequence, identical on every rank."""
    # Gathered along dim 0 (the one funcol gathers on): (..., S_l, ...) -> (P*S_l, ...).
    full = _waited(funcol.all_gather_single(x.movedim(dim, 0).contiguous(), 0, sp.group))
    return full.narrow(0, 0, shard.total).movedim(0, dim)
