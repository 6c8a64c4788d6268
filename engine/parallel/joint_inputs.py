"""Sequence parallelism's input split for DiTs that attend text and image tokens jointly,
with RoPE from per-token ids (Flux.1 and FLUX.2: ``hidden_states``, ``encoder_hidden_states``,
``img_ids``, ``txt_ids``).

Each rank keeps its slice of the text and of the image tokens and the matching id rows, so
RoPE is sliced with them: rank r attends ``[text_r, image_r]``. Called by those families'
``sp.attach``; the family supplies its own attention processor.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ditserve.engine.parallel.processors import SequenceForward, UlyssesProcessor
from ditserve.engine.parallel.sharding import token_input
from ditserve.engine.parallel.tokens import key_mask


def attach_joint_split(model: Any, forward: SequenceForward,
                       processor: UlyssesProcessor) -> None:
    """Hook ``model`` so its forward runs on this rank's tokens, attending through
    ``processor``."""
    sp = forward.group

    def split_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = token_input(kwargs, "hidden_states")  # (B, N, C) image tokens
        text = token_input(kwargs, "encoder_hidden_states")  # (B, T, D) text tokens
        image_ids, text_ids = token_input(kwargs, "img_ids"), token_input(kwargs, "txt_ids")
        # diffusers accepts batched (B, L, axes) ids and uses their first row.
        image_ids, text_ids = (ids[0] if ids.ndim == 3 else ids for ids in (image_ids, text_ids))
        image, txt = sp.shard(hidden.shape[1]), sp.shard(text.shape[1])
        kwargs.update(hidden_states=image.take(hidden, 1), encoder_hidden_states=txt.take(text, 1),
                      img_ids=image.take(image_ids, 0), txt_ids=txt.take(text_ids, 0))
        forward.begin(output=image, key_mask=key_mask([(txt, None), (image, None)],
                                                      rows=hidden.shape[0], device=hidden.device))
        return args, kwargs

    model.register_forward_pre_hook(split_inputs, with_kwargs=True)
    model.set_attn_processor(processor)
