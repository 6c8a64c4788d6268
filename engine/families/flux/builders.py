"""Flux's random-weight pipelines: the embedded tiny model and the ``init-random`` sizes.

The DiT has the family's shapes (``engine.families.flux``: ``DIT_SIZES`` for
``init-random``, ``TINY_DIT`` for the embedded model); around it, tiny CLIP and T5 encoders
whose output widths the DiT expects (T5 ``joint_attention_dim``, CLIP
``pooled_projection_dim``), character-level tokenizers and a tiny VAE with Flux's latent
layout (16 channels, 8x downsampling; the embedded model's: 4 channels, 2x) - or, with
``released``, CLIP-L, T5-XXL and Flux's VAE at their released shapes
(``RELEASED_COMPONENTS``). Called through ``engine.makers.builders``.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from ditserve.engine.families.base import ComponentShape
from ditserve.engine.families.flux import DIT_SIZES, FLUX, TINY_DIT
from ditserve.engine.makers.tiny_model import TINY_MAX_SEQUENCE_LENGTH

# T5 context length per size: real Flux-dev pads prompts to 512 tokens, and so do its tests.
T5_TOKENS = {"full": 512, "small": 512, "tiny": 512}  # as the released tokenizer


def _classes() -> tuple[Any, Any]:
    import diffusers

    return getattr(diffusers, FLUX.pipeline_class), getattr(diffusers, FLUX.dit_class)


def _scheduler() -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    # Dynamic shifting as in real Flux checkpoints, so the mu/shift code path is exercised.
    return FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096,
        base_shift=0.5, max_shift=1.15, shift=3.0,
    )


def tokenizers() -> tuple[Any, Any]:
    """Character-level CLIP and T5 tokenizers (good enough for random weights)."""
    from transformers import CLIPTokenizer, T5Tokenizer

    # Byte-level BPE with no merges is a character-level tokenizer.
    chars = [chr(c) for c in range(33, 127)]
    vocab = {c: i for i, c in enumerate(chars)} | {c + "</w>": 94 + i for i, c in enumerate(chars)}
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    clip = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    # extra_ids=0: the default adds 100 sentinel tokens the tiny embedding would not cover.
    t5 = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=TINY_MAX_SEQUENCE_LENGTH)
    return clip, t5


def _text_encoders(*, t5_width: int, clip_width: int, t5_tokens: int,
                   t5_layers: int) -> dict[str, Any]:
    """Tiny CLIP and T5 encoders (1-2 layers, 4 heads) whose output widths the DiT expects."""
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_tok, t5_tok = tokenizers()
    t5_tok.model_max_length = t5_tokens
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tok), hidden_size=clip_width, intermediate_size=37,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
        projection_dim=32, bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id,
    ))
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tok), d_model=t5_width, d_kv=8, d_ff=37, num_layers=t5_layers,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,  # type: ignore[call-arg]
    ))
    return {"text_encoder": clip, "tokenizer": clip_tok, "text_encoder_2": t5,
            "tokenizer_2": t5_tok}


def _vae(*, levels: int, latent_channels: int, widths: tuple[int, ...]) -> Any:
    from diffusers import AutoencoderKL

    # Flux's latent layout with tiny widths: each level past the first halves the side.
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=widths, layers_per_block=1, latent_channels=latent_channels,
        norm_num_groups=8, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    )


def build_tiny(variant: str, seed: int) -> Any:
    """The embedded default model (``ditserve model init-tiny``; about 1 MB, float32)."""
    import torch

    pipeline_cls, dit_cls = _classes()
    torch.manual_seed(seed)
    encoders = _text_encoders(t5_width=32, clip_width=32, t5_tokens=TINY_MAX_SEQUENCE_LENGTH,
                              t5_layers=2)
    transformer = dit_cls(**TINY_DIT)
    vae = _vae(levels=2, latent_channels=4, widths=(8, 16))
    return pipeline_cls(scheduler=_scheduler(), vae=vae, transformer=transformer, **encoders)


def _released_parts(released: Mapping[str, ComponentShape], *, dtype: Any, device: Any,
                    seed: int, t5_tokens: int) -> dict[str, Any]:
    """The encoders and VAE at the shapes of ``released`` (``engine.makers.released``),
    with the character-level tokenizers; CLIP's special-token ids are the tokenizer's."""
    from ditserve.engine.makers.released import build_released

    clip_tok, t5_tok = tokenizers()
    t5_tok.model_max_length = t5_tokens
    ids = {"text_encoder": dict(bos_token_id=clip_tok.bos_token_id,
                                eos_token_id=clip_tok.eos_token_id,
                                pad_token_id=clip_tok.pad_token_id)}
    parts = build_released(released, dtype=dtype, device=device, seed=seed, ids=ids)
    return {**parts, "tokenizer": clip_tok, "tokenizer_2": t5_tok}


def build_pipeline(variant: str, size: str, *, dtype: Any, device: Any, seed: int,
                   released: Mapping[str, ComponentShape] | None = None) -> Any:
    """A random pipeline with a ``size`` DiT on ``device``; around it the tiny parts, or the
    ``released`` shapes' parts; the small parts stored in ``dtype`` too, so the loader never
    casts (casting would break mmap sharing)."""
    import torch

    from ditserve.engine.makers.builders import make_dit

    pipeline_cls, _ = _classes()
    config = DIT_SIZES[size]
    torch.manual_seed(seed)
    if released is not None:
        parts = _released_parts(released, dtype=dtype, device=device, seed=seed,
                                t5_tokens=T5_TOKENS[size])
    else:
        parts = _text_encoders(t5_width=config["joint_attention_dim"],
                               clip_width=config["pooled_projection_dim"],
                               t5_tokens=T5_TOKENS[size], t5_layers=1)
        parts["vae"] = _vae(levels=4, latent_channels=16, widths=(8, 8, 16, 16))
        for name in ("text_encoder", "text_encoder_2", "vae"):
            parts[name] = parts[name].to(dtype)
    transformer = make_dit(variant, size, dtype=dtype, device=device, seed=seed)
    return pipeline_cls(scheduler=_scheduler(), transformer=transformer, **parts)
