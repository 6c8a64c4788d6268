"""Qwen-Image's random-weight pipelines: a DiT of the asked size amid tiny parts.

Around the DiT (shapes: ``engine.families.qwen_image``): a Qwen2.5-VL text encoder of one or
two layers whose output width the DiT expects (``joint_attention_dim``), a byte-level
tokenizer with the chat template's markers, and a VAE with Qwen-Image's latent layout (16
channels, 8x spatial, one frame) and a few channels - or, with ``released``, Qwen2.5-VL-7B and
the Qwen-Image VAE at their released shapes. Called through ``engine.makers.builders``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.families.base import ComponentShape
from ditserve.engine.families.qwen_image import QWEN_IMAGE


def make_tokenizer(special: tuple[str, ...] = ("<|im_start|>", "<|im_end|>")) -> Any:
    """A byte-level tokenizer with ``special`` (the chat template's markers) as single tokens."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    # Byte-level BPE without merges: one token per byte, any UTF-8 prompt encodes.
    vocab = {ch: i for i, ch in enumerate(sorted(set(bytes_to_unicode().values())))}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    # The chat template's markers as single tokens, as in Qwen2.5-VL's tokenizer.
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    return tokenizer


def make_text_encoder(tokenizer: Any, width: int, **token_ids: Any) -> Any:
    """A Qwen2.5-VL of one or two layers ``width`` wide; ``token_ids``: its vision markers'
    ids in ``tokenizer`` (``image_token_id``, ...) where prompts carry images."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    heads = 2 if width <= 64 else max(1, width // 128)
    half = width // heads // 2  # multimodal RoPE: the sections cover half a head
    sections = [half - 2 * (half // 3), half // 3, half // 3]
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=width, intermediate_size=37,
            num_hidden_layers=1 if width > 64 else 2, num_attention_heads=heads,
            num_key_value_heads=1, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "mrope_section": sections,
                             "rope_theta": 1000000.0},
            bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                           out_hidden_size=width, fullatt_block_indexes=[0]),
        **token_ids,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def make_vae() -> Any:
    from diffusers import AutoencoderKLQwenImage

    # Qwen-Image's latent layout: 16 channels, 8x spatial (three downsamplings), one frame.
    return AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                  temperal_downsample=[False, True, True])


def make_scheduler() -> Any:
    """Qwen-Image's released scheduler: resolution-dependent exponential time shift."""
    import diffusers

    return diffusers.FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
        num_train_timesteps=1000, shift=1.0, shift_terminal=0.02,
        time_shift_type="exponential", use_dynamic_shifting=True)


def make_parts(variant: str, size: str, *, dtype: Any, device: Any, seed: int,
               released: Mapping[str, ComponentShape] | None, tokenizer: Any,
               token_ids: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The tokenizer, text encoder and VAE: tiny ones, or ``released``'s shapes;
    ``token_ids``: the text encoder's vision markers in ``tokenizer`` (edits)."""
    from ditserve.engine.makers.builders import dit_setting
    from ditserve.engine.makers.released import build_released

    extra = dict(token_ids or {})
    if released is not None:
        ids = {"text_encoder": {**extra, "text_config": dict(
            bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id)}}
        return {"tokenizer": tokenizer, **build_released(released, dtype=dtype, device=device,
                                                         seed=seed, ids=ids)}
    width = dit_setting(variant, size, "joint_attention_dim")
    # Stored as served: the loader never casts.
    encoder = make_text_encoder(tokenizer, width, **extra)
    return {"tokenizer": tokenizer, "text_encoder": encoder.to(dtype), "vae": make_vae().to(dtype)}


def build_pipeline(variant: str, size: str, *, dtype: Any, device: Any, seed: int,
                   released: Mapping[str, ComponentShape] | None = None) -> Any:
    """The whole diffusers pipeline object (not saved); the DiT on ``device``."""
    import diffusers
    import torch

    from ditserve.engine.makers.builders import make_dit

    torch.manual_seed(seed)
    parts = make_parts(variant, size, dtype=dtype, device=device, seed=seed, released=released,
                       tokenizer=make_tokenizer())
    dit = make_dit(variant, size, dtype=dtype, device=device, seed=seed)
    pipeline_cls = getattr(diffusers, QWEN_IMAGE.pipeline_class)
    return pipeline_cls(scheduler=make_scheduler(), transformer=dit, **parts)


def build_tiny(variant: str, seed: int) -> Any:
    import torch

    return build_pipeline(variant, "tiny", dtype=torch.float32, device="cpu", seed=seed)
