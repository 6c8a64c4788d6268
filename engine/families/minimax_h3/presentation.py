"""What MiniMax-H3's Qwen3-VL conditioner reads for one request, and its encoding.

diffusers' text-encoder steps: ``MiniMaxH3TextEncoderStep`` (``t2va``: the prompt verbatim,
no template, no special tokens) and ``MiniMaxH3FL2VATextEncoderStep`` (``fl2va``: a
``"<Picture i>: "`` label and a vision block of image tokens per keyframe before the prompt,
the vision rows tagged as video), both read by ``get_qwen3vl_prompt_embeds``: the hidden
state after decoder layer 50, the image tokens filled from the keyframes' vision features
(``encode_ids``, which the ``ref2va`` presentation goes through too). Called by the step
pipeline's ``_encode_prompt`` (``engine.families.minimax_h3.pipeline``) and ``conditioning``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.pipelines.common import upload


def presentation(tokenizer: Any, prompt: str, vision_tokens: Sequence[int], *,
                 text_tag: int, video_tag: int) -> tuple[list[int], list[int]]:
    """The ``fl2va`` presentation, tokenized: per keyframe a ``"<Picture i>: "`` label (text
    rows) and a vision block of ``vision_tokens[i]`` image pads (video rows), then the prompt
    verbatim; no template, no special tokens. Returns the ids and their modality tags."""
    start, pad, end = (tokenizer.convert_tokens_to_ids(t) for t in (
        "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    ids: list[int] = []
    tags: list[int] = []
    for index, count in enumerate(vision_tokens):
        label = tokenizer(f"<Picture {index + 1}>: ", add_special_tokens=False)["input_ids"]
        block = [start] + [pad] * count + [end]
        ids += label + block
        tags += [text_tag] * len(label) + [video_tag] * len(block)
    words = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return ids + words, tags + [text_tag] * len(words)


def vision_inputs(image_processor: Any, keyframes: Sequence[Any]
                  ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The conditioner's vision tensors of the keyframes (one batched processor call) and
    each keyframe's count of vision tokens (its patches over the merge window)."""
    if not keyframes:
        return {}, []
    vision = image_processor(images=list(keyframes), return_tensors="pt")
    grid = vision["image_grid_thw"]
    merge = int(image_processor.merge_size) ** 2
    counts = [int(g.prod()) // merge for g in grid]
    return {"pixel_values": vision["pixel_values"], "image_grid_thw": grid}, counts


@torch.inference_mode()
def encode(text_encoder: Any, tokenizer: Any, image_processor: Any, prompt: str,
           frames: Sequence[Any], *, layer: int, device: torch.device, text_tag: int,
           video_tag: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, L, D) in the encoder's dtype and the (L,) modality tags of its rows: the hidden
    state ``layer`` of the presentation of ``prompt`` after the keyframes ``frames`` (PIL,
    on the canvas)."""
    vision, counts = vision_inputs(image_processor, frames)
    ids, tags = presentation(tokenizer, prompt, counts, text_tag=text_tag, video_tag=video_tag)
    return encode_ids(text_encoder, ids, tags, vision, layer=layer, device=device)


@torch.inference_mode()
def encode_ids(text_encoder: Any, ids: Sequence[int], tags: Sequence[int],
               vision: dict[str, torch.Tensor], *, layer: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_qwen3vl_prompt_embeds`` of a tokenized presentation: (1, L, D) in the encoder's
    dtype (the hidden state ``layer``, its image pads filled from ``vision``) and the (L,)
    modality tags ``tags``. Shared by the keyframe and the reference workflows."""
    config = text_encoder.config
    if int(config.text_config.num_hidden_layers) <= layer:
        raise InvalidRequestError("prompt", f"the text encoder has no layer {layer} "
                                  "(MiniMax-H3 conditions on its hidden state after it)")
    host = torch.tensor([list(ids)], dtype=torch.long)
    # What the processor's create_mm_token_type_ids gives: 1 / 2 on the image / video pad
    # tokens, 0 on text (a text-only prompt: all 0).
    types = torch.zeros_like(host)
    types[host == int(config.image_token_id)] = 1
    types[host == int(config.video_token_id)] = 2
    input_ids = upload(host, device)
    # The vision tensors as diffusers passes them: pixels in the encoder's dtype.
    extra = {name: value.to(device, text_encoder.dtype) if name.startswith("pixel_")
             else upload(value, device) for name, value in vision.items()}
    outputs = text_encoder.model(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=upload(types, device), use_cache=False, output_hidden_states=True,
        **extra)
    text = outputs.hidden_states[layer].to(text_encoder.dtype)
    return text, torch.tensor(tags, dtype=torch.long)
