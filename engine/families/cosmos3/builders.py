"""Cosmos3's random-weight pipelines: a DiT of the asked size amid tiny parts.

Around the DiT (shapes: ``engine.families.cosmos3``): a byte-level tokenizer with the chat
template's markers and ``<|vision_start|>`` (the token that opens the generated tokens), a
Wan 2.2-layout VAE (48 channels, 16x spatial, 4x temporal) with a few channels, a UniPC
scheduler as released, and - where the DiT generates sound - a tiny sound tokenizer (its
decoder only) - or, with ``released``, the Wan 2.2 VAE at its released shape. The safety
checker is off (``enable_safety_checker=False``): its package is not part of ditserve.
Called through ``engine.makers.builders``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.families.base import ComponentShape
from ditserve.engine.families.cosmos3 import COSMOS3

# A Qwen-style chat template: what the released tokenizer's template renders for a system and
# a user turn with the generation prompt (its vision-id options are not used by Cosmos3).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ("<|im_start|>", "<|im_end|>", "<|vision_start|>")
TINY_SAMPLING_RATE = 8000  # AAC's lowest standard rate (the released: 48 kHz)


def make_tokenizer() -> Any:
    """A byte-level tokenizer (any UTF-8 prompt encodes) with the chat markers as tokens."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(sorted(set(bytes_to_unicode().values())))}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_vae() -> Any:
    from diffusers import AutoencoderKLWan

    # Wan 2.2's layout: 48 channels, 16x spatial (2x2 patchified pixels), 4x temporal.
    return AutoencoderKLWan(
        base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
        out_channels=12, patch_size=2, scale_factor_spatial=16,
        latents_mean=[0.0] * 48, latents_std=[1.0] * 48)


def make_sound_tokenizer(channels: int) -> Any:
    """A decoder-only sound tokenizer reading ``channels`` latent channels, hop 40 samples."""
    from diffusers import Cosmos3AVAEAudioTokenizer

    return Cosmos3AVAEAudioTokenizer(
        sampling_rate=TINY_SAMPLING_RATE, vocoder_input_dim=channels, dec_dim=4,
        dec_c_mults=(1, 2), dec_strides=(5, 8), encoder_enabled=False)


def make_scheduler() -> Any:
    """UniPC on flow sigmas, predicting flow velocity (the scheduler Cosmos3 ships)."""
    import diffusers

    return diffusers.UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
        flow_shift=5.0)


def build_pipeline(variant: str, size: str, *, dtype: Any, device: Any, seed: int,
                   released: Mapping[str, ComponentShape] | None = None) -> Any:
    """The whole diffusers pipeline object (not saved); the DiT on ``device``."""
    import diffusers
    import torch

    from ditserve.engine.makers.builders import dit_setting, make_dit
    from ditserve.engine.makers.released import build_released

    torch.manual_seed(seed)
    tokenizer = make_tokenizer()
    if released is not None:
        parts = build_released(released, dtype=dtype, device=device, seed=seed)
    else:
        parts = {"vae": make_vae().to(dtype)}  # stored as served: the loader never casts
    dit = make_dit(variant, size, dtype=dtype, device=device, seed=seed)
    if len(tokenizer) > int(dit.config.vocab_size):
        raise ValueError(f"the tokenizer's {len(tokenizer)} tokens exceed the DiT's vocabulary")
    if dit_setting(variant, size, "sound_gen"):
        parts["sound_tokenizer"] = make_sound_tokenizer(int(dit.config.sound_dim)).to(dtype)
    pipeline_cls = getattr(diffusers, COSMOS3.pipeline_class)
    return pipeline_cls(transformer=dit, text_tokenizer=tokenizer, scheduler=make_scheduler(),
                        enable_safety_checker=False, **parts)


def build_tiny(variant: str, seed: int) -> Any:
    import torch

    return build_pipeline(variant, "tiny", dtype=torch.float32, device="cpu", seed=seed)
