"""Z-Image under sequence parallelism: the hooks that shard its DiT and its processor.

Z-Image's forward builds its token sequences itself, from per-row lists (image patches,
captions), padding the rows of a batch to their longest and masking the rest: the noise
refiner runs on image tokens, the context refiner on caption tokens, the main layers on
each row's ``[image, caption]`` joined. So the shards are cut per block list, where those
sequences exist: the first block of each list takes this rank's tokens of the list's
stream (its RoPE table alike, at every block), the key mask joins the forward's row mask
with the shard's padding, and the last block of the list gathers every rank's tokens back,
so the code between the lists (the joining, the final layer, unpatchify) runs on whole
sequences, unchanged. Named by the family record (``engine.families.z_image``); attached by
``engine.parallel.sharding.shard_dit``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ditserve.engine.families import Z_IMAGE
from ditserve.engine.parallel.processors import SequenceForward, UlyssesProcessor, refuse_mask
from ditserve.engine.parallel.tokens import key_mask
from ditserve.engine.parallel.ulysses import gather_tokens

# A block's positional arguments, as the DiT's forward calls it: (x, attn_mask, freqs_cis,
# adaln_input, ...).
X, MASK, FREQS = 0, 1, 2


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE as Z-Image applies it: pairs of (B, S, H, D) as complex numbers times the
    (B, S, D/2) table, in float32, back in ``x``'s dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs.unsqueeze(2)).flatten(3).type_as(x)


class ZImageUlyssesProcessor(UlyssesProcessor):
    """Z-Image's single-stream attention on this rank's tokens; the row mask arrives in the
    forward's key mask."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        freqs_cis: torch.Tensor | None = None,
    ) -> torch.Tensor:
        refuse_mask(attention_mask)
        # (B, S_l, H*D) -> (B, S_l, H, D)
        query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))
        key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if freqs_cis is not None:
            query, key = rotate(query, freqs_cis), rotate(key, freqs_cis)
        out = attn.to_out[0](self.attend(query, key, value))
        if len(attn.to_out) > 1:  # dropout
            out = attn.to_out[1](out)
        return out


def attach(model: Any, forward: SequenceForward) -> None:
    """Hook the DiT ``model`` so each block list runs on this rank's tokens (``forward``)."""
    sp = forward.group

    def first_block(module: nn.Module, args: tuple[Any, ...]) -> Any:
        # The list's whole stream arrives here: (B, S, D) and its (B, S) row mask, if any.
        hidden, mask = args[X], args[MASK]
        shard = sp.shard(hidden.shape[1])
        keys = key_mask([(shard, mask)], rows=hidden.shape[0], device=hidden.device)
        forward.begin(output=shard, key_mask=keys, stream=shard)
        return (shard.take(hidden, 1), *every_block_args(args)[1:])

    def every_block_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
        # The forward passes each block the whole RoPE table and the row mask: this rank's
        # rows of the table, and no mask (the processor takes the key mask).
        shard = forward.extras["stream"]
        freqs = args[FREQS]
        return (args[X], None, shard.take(freqs, 1) if freqs is not None else None,
                *args[FREQS + 1:])

    def later_block(module: nn.Module, args: tuple[Any, ...]) -> Any:
        return every_block_args(args)

    def last_block(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return gather_tokens(output, forward.extras["stream"], sp, dim=1)

    for name in Z_IMAGE.block_lists:
        blocks = list(model.get_submodule(name))
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(first_block if index == 0 else later_block)
        blocks[-1].register_forward_hook(last_block)
    # The DiT has no set_attn_processor (diffusers' AttentionMixin): set each attention's.
    processor = ZImageUlyssesProcessor(forward)
    for module in model.modules():
        if hasattr(module, "set_processor") and hasattr(module, "processor"):
            module.set_processor(processor)
