"""Z-Image's random-weight pipelines: a DiT of the asked size amid tiny parts.

Around the DiT (shapes: ``engine.families.z_image``): a Qwen3 text encoder of two layers
whose width the DiT's captions expect (``cap_feat_dim``), a byte-level tokenizer with the
Qwen3 chat template's markers and a chat template of the same form, a VAE with Flux's latent
layout (16 channels, 8x spatial) and a few channels, and Z-Image-Turbo's scheduler - or, with
``released``, Qwen3-4B and the VAE at their released shapes. Called through
``engine.makers.builders``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.families.base import ComponentShape
from ditserve.engine.families.z_image import TURBO_SCHEDULER, Z_IMAGE

# The user turn and the assistant's opening, as Qwen3's chat template renders them with
# add_generation_prompt (and enable_thinking, which adds nothing).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer() -> Any:
    """A byte-level tokenizer (one token per byte: any UTF-8 prompt encodes) with the chat
    markers as single tokens and the chat template the pipeline applies."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(sorted(set(bytes_to_unicode().values())))}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], model_max_length=131072)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_text_encoder(tokenizer: Any, width: int) -> Any:
    """A Qwen3 of two layers ``width`` wide (the pipeline reads its second-to-last hidden
    states, so one layer would leave only the embeddings)."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=37,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=width // 2, max_position_embeddings=2048,
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3Model(config)


def make_vae() -> Any:
    from diffusers import AutoencoderKL

    # Flux's latent layout (16 channels, 8x: four levels) with tiny widths.
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16), layers_per_block=1, latent_channels=16,
        norm_num_groups=8, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False)


def make_scheduler() -> Any:
    """Z-Image-Turbo's released scheduler (shift 3, no dynamic shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **TURBO_SCHEDULER)


def build_pipeline(variant: str, size: str, *, dtype: Any, device: Any, seed: int,
                   released: Mapping[str, ComponentShape] | None = None) -> Any:
    """The whole diffusers pipeline object (not saved); the DiT on ``device``; the small
    parts stored in ``dtype`` too, so the loader never casts."""
    import diffusers
    import torch

    from ditserve.engine.makers.builders import dit_setting, make_dit
    from ditserve.engine.makers.released import build_released

    torch.manual_seed(seed)
    tokenizer = make_tokenizer()
    if released is not None:
        ids = {"text_encoder": dict(
            bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id)}
        parts = build_released(released, dtype=dtype, device=device, seed=seed, ids=ids)
    else:
        width = dit_setting(variant, size, "cap_feat_dim")
        parts = {"text_encoder": make_text_encoder(tokenizer, width).to(dtype),
                 "vae": make_vae().to(dtype)}
    dit = make_dit(variant, size, dtype=dtype, device=device, seed=seed)
    pipeline_cls = getattr(diffusers, Z_IMAGE.pipeline_class)
    return pipeline_cls(scheduler=make_scheduler(), transformer=dit, tokenizer=tokenizer,
                        **parts)


def build_tiny(variant: str, seed: int) -> Any:
    import torch

    return build_pipeline(variant, "tiny", dtype=torch.float32, device="cpu", seed=seed)
