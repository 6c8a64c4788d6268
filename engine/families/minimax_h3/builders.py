"""MiniMax-H3's random-weight pipelines: a DiT of the asked size amid tiny parts.

Around the DiT (shapes: ``engine.families.minimax_h3``): a byte-level tokenizer, a Qwen3-VL
conditioner 16 wide with 51 text layers (the pipeline reads the hidden state after layer 50,
so a stack of 50 or fewer is refused) and a one-layer vision tower, the video VAE's layout
(16x spatial, 17 frames -> 5 latent frames per chunk) with 4 latent channels and a one-layer
ViT decoder, a mono audio VAE hopping 200 samples at 8 kHz (40 latents per second, the
released rate), the two MiniMax-H3 schedulers as released (shift 12 for video, 3 for
audio) and a ``processor``: Qwen3-VL's image processor (16 px patches merged 2x2, its
released normalization) beside the tokenizer, which the keyframe workflow reads a first or
last frame into the prompt through (a tiny one reads at most 4 vision tokens of a frame),
and the video processor's ``video_preprocessor_config.json`` (the omni-reference
workflow's video references; a tiny model puts them on a 32 x 64 canvas), and
``transformer_ref``, the omni-reference workflow's DiT (same shape, other weights; a tiny
model encodes image references at a 64 px short edge) - or, with ``released``, the
components at their released shapes. Saved as diffusers saves a
modular pipeline (``modular_model_index.json``). Called through ``engine.makers.builders``.

transformers cannot build ``Qwen3VLProcessor`` without torchvision (its video processor
needs it), so ``vl_processor`` assembles the pieces the workflows use and saves the released
folder layout (the tokenizer's files, ``preprocessor_config.json`` and
``video_preprocessor_config.json``, which transformers' class reads too); diffusers
then names the component ``Qwen3VLProcessor`` in the index, as the released model does.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ditserve.engine.families.base import ComponentShape
from ditserve.engine.families.minimax_h3 import (
    AUDIO_SHIFT,
    TEXT_LAYER,
    TINY_LATENT_CHANNELS,
    VIDEO_SHIFT,
)

TINY_TEXT_WIDTH = 16  # the tiny DiT's text_dim
TINY_SAMPLING_RATE = 8000  # 200-sample hop: the released 40 latents per second
TINY_REFERENCE_SHORT_EDGE = 64  # an image reference's short edge (released: 2048)
# The canvas a tiny model puts a video reference on (short edge, area cap; released: 768,
# 768 x 1344): a tiny clip's own 32 x 64.
TINY_CANVAS = (32, 32 * 64)
REF_SEED_OFFSET = 1  # transformer_ref's weights are drawn from seed + 1
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def make_tokenizer() -> Any:
    """A byte-level tokenizer (any UTF-8 prompt encodes) with Qwen3-VL's vision markers."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(sorted(set(bytes_to_unicode().values())))}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIALS[1:])})
    return tokenizer


def make_text_encoder(tokenizer: Any, *, width: int) -> Any:
    """A Qwen3-VL conditioner ``width`` wide with ``TEXT_LAYER + 1`` text layers."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=16,
                         num_hidden_layers=TEXT_LAYER + 1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, max_position_embeddings=4096,
                         rope_parameters=dict(rope_type="default", rope_theta=5e6,
                                              mrope_section=[2, 1, 1],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=width, patch_size=16, num_position_embeddings=16,
                           deepstack_visual_indexes=[]),
        **ids)
    return Qwen3VLForConditionalGeneration(config)


def make_vae() -> Any:
    """The released video VAE's layout (16x spatial, 4x temporal in chunks of 17 frames)
    with 8 channels, 4 latent channels and a one-layer ViT decoder."""
    from diffusers import AutoencoderKLMiniMaxH3

    return AutoencoderKLMiniMaxH3(
        latent_channels=TINY_LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8),
        layers_per_block=1, spatial_downsample_factors=(2, 2, 2, 2),
        temporal_downsample_factors=(1, 2, 2, 1), norm_num_groups=4, decoder_num_layers=1,
        decoder_num_attention_heads=2, decoder_attention_head_dim=8,
        decoder_num_register_tokens=1, decoder_ffn_mult=1,
        latents_mean=(0.1, -0.2, 0.0, 0.3), latents_std=(0.9, 1.1, 1.0, 1.2))


def make_audio_vae() -> Any:
    """A mono audio VAE, 4 latent channels, hop 200 at 8 kHz (40 latents per second)."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    return AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4, encoder_rates=(2, 4, 5, 5), latent_dim=8,
        latent_channels=TINY_LATENT_CHANNELS, num_attention_heads=2, decoder_dim=32,
        decoder_rates=(5, 5, 2, 2, 2), decoder_kernel_sizes=(9, 9, 4, 4, 4),
        resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),),
        sampling_rate=TINY_SAMPLING_RATE, latents_mean=[0.0, 0.1, -0.1, 0.2],
        latents_std=[1.0, 0.8, 1.2, 1.1])


# Qwen3-VL's image processor as released: 16 px patches, 2x2 merged into one token, two
# frames a temporal patch, pixels normalized to [-1, 1], 256 to 16384 tokens of 32x32 px.
VISION: dict[str, Any] = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
              image_std=[0.5] * 3)
RELEASED_PIXELS = (65536, 16777216)
TINY_PIXELS = (1024, 4096)  # 1 to 4 vision tokens
# Qwen3-VL's video processor: pixels of a whole sampled clip (frames x height x width).
# Full: transformers' Qwen3VLVideoProcessor defaults; tiny: a 2 fps sample of a tiny clip
# is shrunk to 32 x 32 a frame (one vision token a block), so the resize runs too.
RELEASED_VIDEO_PIXELS = (128 * 32 * 32, 768 * 32 * 32)
TINY_VIDEO_PIXELS = (1024, 16384)


def make_image_processor(size: str) -> Any:
    from transformers import Qwen2VLImageProcessorPil

    low, high = TINY_PIXELS if size == "tiny" else RELEASED_PIXELS
    return Qwen2VLImageProcessorPil(size={"shortest_edge": low, "longest_edge": high}, **VISION)


def make_video_processor(size: str) -> Any:
    from ditserve.engine.families.minimax_h3.video_processor import VideoProcessor

    low, high = TINY_VIDEO_PIXELS if size == "tiny" else RELEASED_VIDEO_PIXELS
    return VideoProcessor(min_pixels=low, max_pixels=high, image_mean=(0.5,) * 3,
                          image_std=(0.5,) * 3)


def _save_pieces(processor: Any, save_directory: str | Path, **_: Any) -> None:
    import json

    from ditserve.engine.families.minimax_h3.video_processor import CONFIG_NAME

    processor.tokenizer.save_pretrained(save_directory)
    processor.image_processor.save_pretrained(save_directory)
    if processor.video_processor is not None:  # the file transformers' class reads too
        config = processor.video_processor.to_config()
        (Path(save_directory) / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def vl_processor(tokenizer: Any, images: Any, videos: Any = None) -> Any:
    """A ``Qwen3VLProcessor`` of ``tokenizer``, the image processor ``images`` and the video
    processor ``videos`` (``video_processor.VideoProcessor``) without transformers' class
    check (module docstring); it saves the released folder layout."""
    from transformers import Qwen3VLProcessor

    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    processor.tokenizer, processor.image_processor = tokenizer, images
    processor.video_processor, processor.chat_template = videos, None
    processor.save_pretrained = types.MethodType(_save_pieces, processor)  # type: ignore[method-assign]
    return processor


def make_schedulers() -> dict[str, Any]:
    from diffusers import MiniMaxH3Scheduler

    return {"scheduler": MiniMaxH3Scheduler(shift=VIDEO_SHIFT),
            "audio_scheduler": MiniMaxH3Scheduler(shift=AUDIO_SHIFT)}


def build_pipeline(variant: str, size: str, *, dtype: Any, device: Any, seed: int,
                   released: Mapping[str, ComponentShape] | None = None) -> Any:
    """The whole diffusers modular pipeline object (not saved); the DiT on ``device``."""
    import diffusers
    import torch

    from ditserve.engine.makers.builders import make_dit
    from ditserve.engine.makers.released import build_released

    torch.manual_seed(seed)
    tokenizer = make_tokenizer()
    dit = make_dit(variant, size, dtype=dtype, device=device, seed=seed)
    # The omni-reference workflow's DiT (``ref2va``): the same class and shape, its own
    # weights; tiny models only (a second released-size DiT is another 66 GB to write).
    extra = {} if size != "tiny" else {"transformer_ref": make_dit(
        variant, size, dtype=dtype, device=device, seed=seed + REF_SEED_OFFSET,
        component="transformer_ref")}
    if released is not None:
        parts = build_released(released, dtype=dtype, device=device, seed=seed)
    else:
        width = int(dit.config.text_dim)
        parts = {"text_encoder": make_text_encoder(tokenizer, width=width).to(dtype),
                 "vae": make_vae().to(dtype), "audio_vae": make_audio_vae().to(dtype)}
    pipe: Any = diffusers.MiniMaxH3ModularPipeline(blocks=diffusers.MiniMaxH3Blocks())
    kind = "tiny" if released is None else "full"
    processor = vl_processor(tokenizer, make_image_processor(kind), make_video_processor(kind))
    pipe.update_components(transformer=dit, tokenizer=tokenizer, processor=processor,
                           **make_schedulers(), **parts, **extra)
    if size == "tiny":
        # A tiny model encodes an image reference at a 64 px short edge (the released 2048
        # would make thousands of rows of a tiny frame); saved in modular_model_index.json,
        # which diffusers' ref2va setup step and the engine both read.
        pipe.register_to_config(reference_image_short_edge=TINY_REFERENCE_SHORT_EDGE,
                                canvas_short_edge=TINY_CANVAS[0],
                                canvas_max_pixels=TINY_CANVAS[1])
    return pipe


def build_tiny(variant: str, seed: int) -> Any:
    import torch

    return build_pipeline(variant, "tiny", dtype=torch.float32, device="cpu", seed=seed)
