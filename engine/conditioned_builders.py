"""Random-weight diffusers pipelines of the image-conditioned families, at a chosen DiT size.

The same recipe as ``model_builders`` (a DiT of the asked size inside deliberately tiny text
encoders, tokenizers and VAE with the family's latent layout), for the layouts that take an
input image:

- ``flux-kontext``: a FluxKontextPipeline; ``full`` is FLUX.1-Kontext-dev's DiT (Flux.1's
  architecture: 19 + 38 blocks, 3072 wide). The tiny VAE downsamples 16x (five levels), so
  a source at Kontext's preferred ~1 MP resolution is 1024 tokens and CPU tests stay fast.

- ``wan-i2v``: a WanImageToVideoPipeline; ``full`` is Wan2.1-I2V-14B-480P's DiT (40 blocks
  5120 wide, 36 input channels, image context 1280 wide) with a two-layer CLIP vision
  encoder of that width; ``wan2.2-ti2v-i2v``: Wan2.2-TI2V-5B's DiT in the same layout
  (``expand_timesteps``, no image encoder).

Called by ``tiny_model.init_tiny`` and ``random_model.init_random`` (``ditserve model
init-tiny`` / ``init-random``); nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

from ditserve.engine.errors import ConfigError

# Built by build_pipeline; flux-kontext by tiny_model / random_model with kontext_from_flux.
VARIANTS: tuple[str, ...] = ("wan-i2v", "wan2.2-ti2v-i2v")

def kontext_tiny_vae() -> Any:
    from diffusers import AutoencoderKL

    # Four latent channels (the tiny DiT's 16 input channels after 2x2 packing), five levels:
    # 16x downsampling.
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 5, up_block_types=("UpDecoderBlock2D",) * 5,
        block_out_channels=(8,) * 5, layers_per_block=1, latent_channels=4, norm_num_groups=8,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
        use_post_quant_conv=False,
    )


def kontext_from_flux(flux: Any, *, tiny: bool) -> Any:
    """A FluxKontextPipeline of a Flux pipeline's parts (Kontext's DiT is Flux.1's; its
    scheduler is FLUX.1-dev's); a tiny one gets the 16x tiny VAE."""
    from diffusers import FluxKontextPipeline

    parts = {name: module for name, module in flux.components.items()
             if name not in ("image_encoder", "feature_extractor")}
    if tiny:
        parts["vae"] = kontext_tiny_vae().to(parts["vae"].dtype)
    return FluxKontextPipeline(**parts)


def _clip_vision(width: int, image_size: int) -> tuple[Any, Any]:
    """A CLIP vision encoder of ``width`` (Wan's image context) and its image processor."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    patch = 8 if image_size < 64 else 14
    encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=width, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        image_size=image_size, patch_size=patch))
    processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                   crop_size={"height": image_size, "width": image_size})
    return encoder, processor


def _wan_i2v(variant: str, size: str, *, dtype: Any, device: Any, seed: int) -> Any:
    import torch
    from diffusers import UniPCMultistepScheduler, WanImageToVideoPipeline

    from ditserve.engine import model_builders as mb

    torch.manual_seed(seed)
    ti2v = variant == "wan2.2-ti2v-i2v"
    tokenizer = mb._t5_tokenizer()
    dit_config = {**mb._defaults(variant), **mb.dit_config(variant, size)}
    parts: dict[str, Any] = {"tokenizer": tokenizer,
                             "text_encoder": mb._umt5(tokenizer, int(dit_config["text_dim"])),
                             "vae": mb._wan_vae(ti2v)}
    if not ti2v:  # Wan 2.1 I2V: a CLIP image context as wide as the DiT's image_dim
        encoder, processor = _clip_vision(int(dit_config["image_dim"]),
                                          32 if size == "tiny" else 224)
        parts |= {"image_encoder": encoder, "image_processor": processor}
    for name in ("text_encoder", "vae", "image_encoder"):
        if name in parts:
            parts[name] = parts[name].to(dtype)  # stored as served: the loader never casts
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
        flow_shift=5.0 if ti2v else 3.0)  # the released 480P I2V and TI2V shifts
    dit = mb.build_dit(variant, size, dtype=dtype, device=device, seed=seed)
    return WanImageToVideoPipeline(scheduler=scheduler, transformer=dit,
                                   expand_timesteps=ti2v, **parts)


def build_pipeline(variant: str, size: str, *, dtype: Any, device: Any, seed: int) -> Any:
    """The whole diffusers pipeline object of an image-conditioned variant (not saved)."""
    if variant in ("wan-i2v", "wan2.2-ti2v-i2v"):
        return _wan_i2v(variant, size, dtype=dtype, device=device, seed=seed)
    raise ConfigError(f"no image-conditioned builder for {variant!r}; known: "
                      f"{', '.join(VARIANTS)}")
