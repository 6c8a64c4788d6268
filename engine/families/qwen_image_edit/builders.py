"""Qwen-Image-Edit's random-weight pipelines (one image and several: the Plus layout).

Qwen-Image's tiny parts (``engine.families.qwen_image.builders``) with what an edit adds: the tokenizer
knows Qwen2.5-VL's vision markers, the text encoder's config names their ids (its vision
tower, one block, reads the source image inside the prompt), and a ``processor`` of that
tokenizer and Qwen2.5-VL's image processor (a tiny one reads at most 16 vision tokens of an
image). Called through ``engine.makers.builders``.

transformers cannot build its ``Qwen2VLProcessor`` without torchvision (the class check
wants a video processor), so ``vl_processor`` assembles one of the two pieces a prompt with
images uses - what the diffusers pipeline object calls - and saves it as the released models
lay out their ``processor`` folder (the tokenizer's files and ``preprocessor_config.json``).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ditserve.engine.families import family_of_variant
from ditserve.engine.families.base import ComponentShape
from ditserve.engine.families.qwen_image import builders as qwen_image

VISION_MARKERS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH = 28  # a vision token: Qwen2.5-VL's 14-pixel patches merged 2x2
RELEASED_PIXELS = (3136, 12845056)  # Qwen2.5-VL's image processor: min and max pixels
TINY_PIXELS = (3136, PATCH * PATCH * 16)


def image_processor(size: str) -> Any:
    from transformers import Qwen2VLImageProcessorPil

    low, high = TINY_PIXELS if size == "tiny" else RELEASED_PIXELS
    return Qwen2VLImageProcessorPil(size={"shortest_edge": low, "longest_edge": high})


def _save_pieces(processor: Any, save_directory: str | Path, **_: Any) -> None:
    processor.tokenizer.save_pretrained(save_directory)
    processor.image_processor.save_pretrained(save_directory)


def vl_processor(tokenizer: Any, images: Any) -> Any:
    """A ``Qwen2VLProcessor`` of ``tokenizer`` and the image processor ``images`` without
    transformers' class check (see the module docstring); it tokenizes prompts with images
    exactly as the released processor does and saves the released folder layout."""
    from transformers import Qwen2VLProcessor

    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    processor.tokenizer, processor.image_processor = tokenizer, images
    processor.video_processor, processor.chat_template = None, None
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    processor.save_pretrained = types.MethodType(_save_pieces, processor)  # type: ignore[method-assign]
    return processor


def build_pipeline(variant: str, size: str, *, dtype: Any, device: Any, seed: int,
                   released: Mapping[str, ComponentShape] | None = None) -> Any:
    """The whole diffusers pipeline object (not saved); the DiT on ``device``; with
    ``released``, Qwen-Image's text encoder and VAE at those shapes."""
    import diffusers
    import torch

    from ditserve.engine.makers.builders import make_dit

    torch.manual_seed(seed)
    tokenizer = qwen_image.make_tokenizer(("<|im_start|>", "<|im_end|>", *VISION_MARKERS))
    ids = {f"{name}_id": tokenizer.convert_tokens_to_ids(marker) for name, marker in (
        ("vision_start_token", "<|vision_start|>"), ("vision_end_token", "<|vision_end|>"),
        ("image_token", "<|image_pad|>"), ("video_token", "<|video_pad|>"))}
    parts = qwen_image.make_parts(variant, size, dtype=dtype, device=device, seed=seed,
                                  released=released, tokenizer=tokenizer, token_ids=ids)
    parts["processor"] = vl_processor(tokenizer, image_processor(size))
    dit = make_dit(variant, size, dtype=dtype, device=device, seed=seed)
    family = family_of_variant(variant)
    assert family is not None
    return getattr(diffusers, family.pipeline_class)(
        transformer=dit, scheduler=qwen_image.make_scheduler(), **parts)


def build_tiny(variant: str, seed: int) -> Any:
    import torch

    return build_pipeline(variant, "tiny", dtype=torch.float32, device="cpu", seed=seed)
