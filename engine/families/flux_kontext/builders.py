"""FLUX.1 Kontext's random-weight pipelines: Flux's, in the Kontext layout.

Kontext's DiT is Flux.1's and its scheduler FLUX.1-dev's, so the pipeline is Flux's builder
output (``engine.families.flux.builders``) in the family's diffusers pipeline class; a tiny one gets a
16x tiny VAE (five levels), so a source at Kontext's preferred ~1 MP resolution is 1024
tokens and CPU tests stay fast. Called through ``engine.makers.builders``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.families.base import ComponentShape
from ditserve.engine.families.flux import builders as flux
from ditserve.engine.families.flux_kontext import FLUX_KONTEXT


def _tiny_vae() -> Any:
    from diffusers import AutoencoderKL

    # Four latent channels (the tiny DiT's 16 input channels after 2x2 packing), five levels:
    # 16x downsampling.
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 5, up_block_types=("UpDecoderBlock2D",) * 5,
        block_out_channels=(8,) * 5, layers_per_block=1, latent_channels=4, norm_num_groups=8,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _from_flux(pipeline: Any, *, tiny: bool) -> Any:
    """The family's pipeline of a Flux pipeline's parts; a tiny one gets the 16x tiny VAE."""
    import diffusers

    parts = {name: module for name, module in pipeline.components.items()
             if name not in ("image_encoder", "feature_extractor")}
    if tiny:
        parts["vae"] = _tiny_vae().to(parts["vae"].dtype)
    return getattr(diffusers, FLUX_KONTEXT.pipeline_class)(**parts)


def build_pipeline(variant: str, size: str, *, dtype: Any, device: Any, seed: int,
                   released: Mapping[str, ComponentShape] | None = None) -> Any:
    pipeline = flux.build_pipeline("flux", size, dtype=dtype, device=device, seed=seed,
                                   released=released)
    # With released shapes (a test's scaled table around a tiny DiT) the VAE is the table's:
    # init-random has already written it as the pipeline's.
    return _from_flux(pipeline, tiny=size == "tiny" and released is None)


def build_tiny(variant: str, seed: int) -> Any:
    return _from_flux(flux.build_tiny("flux", seed), tiny=True)
