"""Wan 2.x's random-weight pipelines: Wan 2.1, Wan 2.2 with two experts, Wan 2.2 TI2V.

Around the DiT (shapes and the variants' settings: ``engine.families.wan``): a UMT5 text
encoder of one or two layers whose output width the DiT expects (``text_dim``), a
character-level tokenizer, and a VAE with the variant's latent layout (Wan 2.1: 16
channels, 8x spatial, 4x temporal; Wan 2.2 TI2V: 48 channels, 16x spatial) and a few
channels - or, with ``released``, UMT5-XXL and the variant's VAE at their released shapes.
Called through ``engine.makers.builders``.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from ditserve.engine.families.base import ComponentShape
from ditserve.engine.families.wan import EXPERTS, TI2V, WAN, WAN22_BOUNDARY_RATIO


def make_tokenizer(tokens: int) -> Any:
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    # extra_ids=0: the default adds 100 sentinel tokens the tiny embedding would not cover.
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=tokens)


def make_umt5(tokenizer: Any, width: int) -> Any:
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=width, d_kv=8, d_ff=37,
        num_layers=1 if width > 64 else 2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,  # type: ignore[call-arg]
    ))


def make_vae(ti2v: bool) -> Any:
    from diffusers import AutoencoderKLWan

    if ti2v:  # Wan 2.2's VAE: 48 channels, 16x spatial (2x2 patchified pixels), 4x temporal
        return AutoencoderKLWan(
            base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
            out_channels=12, patch_size=2, scale_factor_spatial=16,
            latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
    # Wan 2.1's layout: 16 channels, 8x spatial, 4x temporal.
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True])


def text_and_vae(variant: str, size: str, *, dtype: Any, device: Any, seed: int,
                 released: Mapping[str, ComponentShape] | None,
                 wan22_vae: bool | None = None) -> dict[str, Any]:
    """The tokenizer and, tiny or at ``released``'s shapes, every other part but the DiT
    (``text_encoder``, ``vae`` and, where the table has one, ``image_encoder``).
    ``wan22_vae``: the tiny VAE in Wan 2.2's layout (default: for the TI2V variant; the
    image-to-video family passes it for its own TI2V variant)."""
    from ditserve.engine.makers.builders import TEXT_TOKENS, dit_setting
    from ditserve.engine.makers.released import build_released

    tokenizer = make_tokenizer(TEXT_TOKENS)
    if released is not None:
        return {"tokenizer": tokenizer,
                **build_released(released, dtype=dtype, device=device, seed=seed)}
    width = int(dit_setting(variant, size, "text_dim"))
    # Stored as served: the loader never casts.
    return {"tokenizer": tokenizer, "text_encoder": make_umt5(tokenizer, width).to(dtype),
            "vae": make_vae(variant == TI2V if wan22_vae is None else wan22_vae).to(dtype)}


def build_pipeline(variant: str, size: str, *, dtype: Any, device: Any, seed: int,
                   released: Mapping[str, ComponentShape] | None = None) -> Any:
    """The whole diffusers pipeline object (not saved); the DiTs on ``device``."""
    import diffusers
    import torch

    from ditserve.engine.makers.builders import make_dit

    torch.manual_seed(seed)
    parts = text_and_vae(variant, size, dtype=dtype, device=device, seed=seed,
                         released=released)
    scheduler = diffusers.UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
        flow_shift=5.0 if variant == TI2V else 3.0)
    dit = make_dit(variant, size, dtype=dtype, device=device, seed=seed)
    extra: dict[str, Any] = {}
    if variant == EXPERTS:
        extra = {"transformer_2": make_dit(variant, size, dtype=dtype, device=device,
                                           seed=seed + 1, component="transformer_2"),
                 "boundary_ratio": WAN22_BOUNDARY_RATIO}
    if variant == TI2V:
        extra = {"expand_timesteps": True}
    pipeline_cls = getattr(diffusers, WAN.pipeline_class)
    return pipeline_cls(scheduler=scheduler, transformer=dit, **parts, **extra)


def build_tiny(variant: str, seed: int) -> Any:
    import torch

    return build_pipeline(variant, "tiny", dtype=torch.float32, device="cpu", seed=seed)
