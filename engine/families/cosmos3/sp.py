"""Cosmos3 under sequence parallelism: its DiT's shard seams and its Ulysses processor.

Cosmos3's DiT has the seams for it: ``_cp_shard_fn`` runs on the joint sequence's two
pathways (every prompt's tokens; every sequence's generated tokens) and their RoPE tables
just before the decoder layers, ``_cp_gather_fn`` on the layers' normed outputs. Here the
first slices each pathway to this rank's tokens (each padded on its own, ``TokenShard``),
the second gathers the generated tokens back (the prompt's outputs are never read: the
vision and sound heads read generated positions only, so the prompt pathway gets a zero
placeholder instead of a gather). Its proj_out then reads the whole sequence on every rank:
the DiT gathers its output itself.

In each layer the processor projects this rank's tokens (every head), turns them into
every token for this rank's head group (one all-to-all per pathway: queries, then keys and
values), attends item by item exactly as unsharded (``packing.attend_items``: the prompt
causally, the generated tokens over their prompt and themselves; the padding after the last
item is never attended), and turns the result back into this rank's tokens. Grouped-query
attention splits its key-value heads the same way, so the SP size must divide them (8 in the
released DiTs). Named by the family record; attached by ``engine.parallel.sharding``.
"""

from __future__ import annotations

from typing import Any

import torch

from ditserve.engine.families.cosmos3.packing import Projected, attend_items, project, segments
from ditserve.engine.parallel.processors import SequenceForward, UlyssesProcessor
from ditserve.engine.parallel.ulysses import (
    check_heads,
    gather_tokens,
    heads_to_sequence,
    sequence_to_heads,
)

UND, UND_TOTAL, GEN_TOTAL = "und", "und_total", "gen_total"  # the forward's extras


class Cosmos3UlyssesProcessor(UlyssesProcessor):
    """Cosmos3's two-pathway attention on this rank's tokens (see module doc)."""

    def __call__(self, attn: Any, und_seq: torch.Tensor, gen_seq: torch.Tensor,
                 rotary_emb: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        sp, extras = self.forward.group, self.forward.extras
        local = project(attn, und_seq, gen_seq, rotary_emb)  # (S_l, H, D) each

        def heads(*tensors: torch.Tensor) -> list[torch.Tensor]:
            # (S_l, H, D) each -> (P * S_l, H / P, D) each: every token, this rank's heads.
            gathered = sequence_to_heads(tuple(t.unsqueeze(0) for t in tensors), sp)
            return list(gathered.squeeze(1).unbind(0))

        q_und, = heads(local.query_und)
        k_und, k_und_gen, v_und = heads(local.key_und, local.key_und_for_gen, local.value_und)
        q_gen, = heads(local.query_gen)
        k_gen, v_gen = heads(local.key_gen, local.value_gen)
        full = Projected(q_und, k_und, k_und_gen, v_und, q_gen, k_gen, v_gen)
        items = segments(int(extras[UND_TOTAL]), int(extras[GEN_TOTAL]))
        und, gen = attend_items(full, items, backend=self._attention_backend)

        def tokens(x: torch.Tensor) -> torch.Tensor:
            # (P * S_l, H/P * D) -> (S_l, H * D): this rank's tokens, every head.
            out = heads_to_sequence(x.unflatten(-1, (-1, attn.head_dim)).unsqueeze(0), sp)
            return out.squeeze(0).flatten(-2, -1)

        return attn.to_out(tokens(und)), attn.to_add_out(tokens(gen))


def attach(model: Any, forward: SequenceForward) -> bool:
    """Hook the DiT ``model`` so its layers run on this rank's tokens (``forward``); True:
    the DiT gathers its output itself (module doc)."""
    sp = forward.group
    check_heads(int(model.config.num_key_value_heads), sp.size,
                what=f"{type(model).__name__}'s key-value heads")

    def shard(und: torch.Tensor, gen: torch.Tensor, rotary: tuple[torch.Tensor, ...]) -> Any:
        und_shard, gen_shard = sp.shard(int(und.shape[0])), sp.shard(int(gen.shape[0]))
        forward.begin(output=gen_shard, key_mask=None, **{
            UND: und_shard, UND_TOTAL: und_shard.total, GEN_TOTAL: gen_shard.total})
        cos_und, sin_und, cos_gen, sin_gen = rotary
        return (und_shard.take(und, 0), gen_shard.take(gen, 0),
                (und_shard.take(cos_und, 0), und_shard.take(sin_und, 0),
                 gen_shard.take(cos_gen, 0), gen_shard.take(sin_gen, 0)))

    def gather(und: torch.Tensor, gen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert forward.output is not None, "the shard seam plans the shards"
        full_gen = gather_tokens(gen, forward.output, sp, dim=0)
        # The prompt's outputs are never read (module doc): a placeholder of their length.
        und_total = int(forward.extras[UND_TOTAL])
        forward.end()
        return und.new_zeros((und_total, *und.shape[1:])), full_gen

    model._cp_shard_fn = shard
    model._cp_gather_fn = gather
    model.set_attn_processor(Cosmos3UlyssesProcessor(forward))
    return True
