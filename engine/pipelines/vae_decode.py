"""VAE decode under the budget: when a decode runs tiled and sliced, and how.

Policy (``tiling_wanted``, pure) apart from mechanism (``VaeTiling``, which sets diffusers'
own switches). Tiling uses diffusers' ``enable_tiling`` / ``enable_slicing`` of each VAE
(AutoencoderKL for Flux, AutoencoderKLQwenImage, AutoencoderKLWan): the latent is decoded in
overlapping spatial tiles blended at the seams, one batch row at a time, so the decode's
activation peak is one tile's instead of the whole frame's. Wan's VAE already decodes one
latent frame at a time (its causal feature cache), which is its temporal chunking; tiling
adds the spatial split.

The rule of ``auto`` (docs/offload.md, "Whole pipeline"): tile only under DLO (resident
serving has the HBM for a whole decode and tiling changes pixels slightly) and only when a
decoded frame is large: an image of at least 1024x1024 pixels, or a video frame above 480p
(more than 832x480 pixels). ``on`` tiles every decode larger than one tile; ``off`` never.
Under an HBM budget the runner decides from the budget instead (``runner.decode_batches``).

Tiled decode is not bit-exact: tiles see less context at their borders and the seams are
blended. ``tests/pipelines/test_vae_decode.py`` measures the difference on tiny models.

Used by ``engine.placement.decode_batches``, which sets the tiling around each decode call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

IMAGE_TILING_PIXELS = 1024 * 1024  # images at or above this many pixels tile under auto
VIDEO_TILING_PIXELS = 832 * 480  # video frames above this many pixels (480p) tile under auto
# The tile edge in pixels. diffusers' AutoencoderKL default is the config's sample_size (1024
# for Flux), which would leave a 1024x1024 image in one tile; 512 is diffusers' usual tile for
# SD-sized VAEs and 2x the Wan / Qwen-Image default (256), so fewer seams there.
DEFAULT_TILE_PIXELS = 512


def tiling_wanted(mode: str, *, offload: bool, height: int, width: int, video: bool) -> bool:
    """Whether a decode of (height, width) frames tiles under ``mode`` (auto, on, off)."""
    if mode == "on":
        return True
    if mode == "off" or not offload:
        return False
    pixels = height * width
    return pixels > VIDEO_TILING_PIXELS if video else pixels >= IMAGE_TILING_PIXELS


class VaeTiling:
    """Turns one VAE's tiled + sliced decode on and off (diffusers' own code paths)."""

    def __init__(self, vae: Any, *, tile_pixels: int = DEFAULT_TILE_PIXELS) -> None:
        if not (hasattr(vae, "enable_tiling") and hasattr(vae, "disable_tiling")):
            raise TypeError(f"{type(vae).__name__} has no diffusers tiling")
        self.vae = vae
        self.tile_pixels = tile_pixels
        if hasattr(vae, "tile_sample_min_size"):  # AutoencoderKL: one square tile size
            vae.tile_sample_min_size = tile_pixels
            scale = 2 ** (len(vae.config.block_out_channels) - 1)
            vae.tile_latent_min_size = tile_pixels // scale
        elif hasattr(vae, "tile_sample_min_height"):  # Wan / Qwen-Image: height, width, stride
            vae.tile_sample_min_height = vae.tile_sample_min_width = tile_pixels
            # diffusers' default stride is 3/4 of its 256 tile: keep that overlap ratio.
            vae.tile_sample_stride_height = vae.tile_sample_stride_width = tile_pixels * 3 // 4
        self.set(False)

    def set(self, on: bool) -> None:
        if on:
            self.vae.use_tiling = True
            self.vae.use_slicing = True
        else:
            self.vae.use_tiling = False
            self.vae.use_slicing = False

    @property
    def on(self) -> bool:
        return bool(self.vae.use_tiling)


def tiled_post_decode(
    post_decode: Callable[[Any], None],
    tiling: VaeTiling,
    *,
    mode: str,
    offload: bool,
    video: bool,
) -> Callable[[Any], None]:
    """``post_decode`` that tiles each request's decode when ``tiling_wanted`` says so."""

    def decode(state: Any) -> None:
        params = state.params
        tiling.set(tiling_wanted(mode, offload=offload, height=int(params.height),
                                 width=int(params.width), video=video))
        try:
            post_decode(state)
        finally:
            tiling.set(False)

    return decode
