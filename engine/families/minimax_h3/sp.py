"""MiniMax-H3 under sequence parallelism: the hooks that shard its DiT and its processor.

The packed sequence first exists inside the forward (the rows are scattered into it), so
it is split where diffusers' own context-parallel plan splits it: the root pre-hook plans
the shards from the sequence's length (``position_ids``), a hook on ``rope`` slices the
rotary tables, the first block's pre-hook slices the rows, every block's pre-hook slices its
row-to-modulation indices, and ``norm_out``'s pre-hook slices the rows' timestep indices;
``norm_out``'s output is gathered back, so both output heads read the whole sequence and
select their rows with sequence-wide indices, as unsharded. The token refiner runs before
the split, on the whole text stream, on every rank.

In each block the processor projects this rank's rows (every head), turns them into every
row for this rank's head group (all-to-all), attends item by item exactly as unsharded
(``packing.attend_segments``; the padding after the last item is never attended) and turns
the result back into this rank's rows. Named by the family record; attached by
``engine.parallel.sharding``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ditserve.engine.families.minimax_h3.packing import (
    attend_segments,
    project,
    segments,
)
from ditserve.engine.parallel.processors import SequenceForward, UlyssesProcessor
from ditserve.engine.parallel.sharding import token_input
from ditserve.engine.parallel.ulysses import (
    check_heads,
    gather_tokens,
    heads_to_sequence,
    sequence_to_heads,
)

TOTAL = "total"  # the forward's extra: the packed sequence's length


class MiniMaxH3UlyssesProcessor(UlyssesProcessor):
    """A block's attention on this rank's rows (see module doc)."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("MiniMax-H3's packed forward takes no attention_mask")
        sp = self.forward.group
        query, key, value = project(attn, hidden_states, rotary_emb)  # (B, S_l, H, D)
        q, k, v = sequence_to_heads((query, key, value), sp).unbind(0)  # (B, P*S_l, H/P, D)
        lengths = segments("items", int(self.forward.extras[TOTAL]))
        out = attend_segments(q, k, v, lengths, backend=self._attention_backend)
        out = heads_to_sequence(out.unflatten(-1, (q.shape[2], -1)).to(query.dtype), sp)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3)))  # type: ignore[no-any-return]


def attach(model: Any, forward: SequenceForward) -> bool:
    """Hook the DiT ``model`` so its blocks run on this rank's rows (``forward``); True:
    the DiT gathers its rows itself (at ``norm_out``, module doc)."""
    sp = forward.group
    check_heads(int(model.config.num_attention_heads), sp.size,
                what=f"{type(model).__name__}'s attention heads")

    def plan_shards(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        total = int(token_input(kwargs, "position_ids").shape[0])
        forward.begin(output=sp.shard(total), key_mask=None, **{TOTAL: total})
        return args, kwargs

    def shard() -> Any:
        assert forward.output is not None, "the root pre-hook plans the shards"
        return forward.output

    def slice_rope(module: nn.Module, args: Any, output: Any) -> Any:
        cos, sin = output  # (S, D) each
        return shard().take(cos, 0), shard().take(sin, 0)

    def split_rows(module: nn.Module, args: tuple[Any, ...]) -> Any:
        # block(hidden_states, temb, adaln_indices, rotary_emb)
        hidden, temb, indices, *rest = args
        return (shard().take(hidden, 1), temb, shard().take(indices, 0), *rest)

    def split_indices(module: nn.Module, args: tuple[Any, ...]) -> Any:
        hidden, temb, indices, *rest = args
        return (hidden, temb, shard().take(indices, 0), *rest)

    def gather(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return gather_tokens(output, shard(), sp, dim=1)

    model.register_forward_pre_hook(plan_shards, with_kwargs=True)
    model.rope.register_forward_hook(slice_rope)
    for index, block in enumerate(model.transformer_blocks):
        block.register_forward_pre_hook(split_rows if index == 0 else split_indices)
    model.norm_out.register_forward_pre_hook(split_indices)  # (hidden, temb, timestep_indices)
    model.norm_out.register_forward_hook(gather)
    for block in model.transformer_blocks:
        block.attn.set_processor(MiniMaxH3UlyssesProcessor(forward))
    return True
