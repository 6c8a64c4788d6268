"""Z-Image from a source image: image-to-image and inpainting, as diffusers'
``ZImageImg2ImgPipeline`` and ``ZImageInpaintPipeline`` run them, on the text-to-image
pipeline's denoise (the DiT's forward does not change: the source enters through the
initial latents and, inpainting, through a blend after every step).

- start: the source, resized to the request's size by diffusers' own image processor, is
  encoded by the VAE and sampled with the request's seeded generator; the noise is drawn
  from the same generator after it; the latents start at the schedule's first kept sigma,
  ``sigma * noise + (1 - sigma) * source`` (``strength`` drops the schedule's first steps);
- inpainting: after each step the kept region (mask 0) is put back at the next step's noise
  level, ``(1 - mask) * (sigma' * noise + (1 - sigma') * source) + mask * latents``, and
  at the clean source after the last step.

diffusers also encodes the masked source (its ``masked_image_latents``), which its loop never
reads; it is drawn after everything above from the generator, so skipping it changes
nothing. Nothing here syncs the host: the draws are made on the CPU and uploaded from pinned
memory, and the sigmas enter as host numbers (rounded to the latents' dtype first, as
diffusers' tensor arithmetic rounds them). Called by ``engine.families.z_image.pipeline``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ditserve.engine.pipelines.common import upload
from ditserve.engine.pipelines.conditioning import to_pil
from ditserve.engine.request import SamplingParams
from ditserve.engine.step.sampler import Schedule

MASK_KEY = "inpaint"  # DenoiseState.host key of a request's Inpainting


@dataclass(frozen=True)
class Inpainting:
    """What the blend after each step needs: the source latents, the noise they started
    from and the (n, 1, h, w) mask (1: repaint, 0: keep)."""

    source: torch.Tensor
    noise: torch.Tensor
    mask: torch.Tensor

    def blend(self, latents: torch.Tensor, schedule: Schedule, step_index: int) -> torch.Tensor:
        """The latents after step ``step_index`` (already taken) with the kept region put
        back at the noise level of the next step (the clean source after the last)."""
        kept = self.source
        if step_index + 1 < schedule.num_steps:
            kept = noised(self.source, self.noise, schedule.sigmas[step_index + 1])
        return (1 - self.mask) * kept + self.mask * latents


def noised(source: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``sigma * noise + (1 - sigma) * source`` (diffusers' ``scale_noise``) with the host
    scalar ``sigma`` as diffusers' arithmetic has it: in the tensors' dtype."""
    rounded = sigma.to(source.dtype)  # on the host: no copy to the device
    return float(rounded) * noise + float(1.0 - rounded) * source


class SourceImages:
    """Initial latents from a request's source image, and its inpainting blend."""

    def __init__(self, vae: Any, *, pixel_multiple: int, device: torch.device) -> None:
        from diffusers.image_processor import VaeImageProcessor

        self.vae = vae
        self.device = device
        # The processors diffusers' pipelines build (16-pixel multiples; the mask binarized).
        self.images = VaeImageProcessor(vae_scale_factor=pixel_multiple)
        self.masks = VaeImageProcessor(vae_scale_factor=pixel_multiple, do_normalize=False,
                                       do_binarize=True, do_convert_grayscale=True)

    @staticmethod
    def kept_schedule(schedule: Schedule, params: SamplingParams) -> tuple[Schedule, int]:
        """The schedule without the steps ``strength`` drops, and how many it dropped."""
        start = params.num_inference_steps - params.denoise_steps
        return Schedule(schedule.timesteps[start:], schedule.sigmas[start:]), start

    def start(self, params: SamplingParams, *, seed: int, schedule: Schedule,
              latent_shape: tuple[int, ...], dtype: torch.dtype
              ) -> tuple[torch.Tensor, Inpainting | None]:
        """(initial latents, the inpainting blend or None) for a request with one source;
        ``schedule``: the kept one; ``dtype``: the captions' (diffusers prepares the
        latents in the prompt embeddings' dtype)."""
        n = latent_shape[0]
        generator = torch.Generator("cpu").manual_seed(seed)
        pixels = self.images.preprocess(to_pil(params.images[0]), height=params.height,
                                        width=params.width).to(torch.float32)
        encoded = self.vae.encode(upload(pixels, self.device).to(dtype)).latent_dist
        # latent_dist.sample(generator), its draw made on the host and uploaded.
        draw = torch.randn(tuple(encoded.mean.shape), generator=generator,
                           dtype=encoded.parameters.dtype)
        source = encoded.mean + encoded.std * upload(draw, self.device)
        source = (source - self.vae.config.shift_factor) * self.vae.config.scaling_factor
        source = source.repeat(n, 1, 1, 1)
        noise = upload(torch.randn(latent_shape, generator=generator, dtype=dtype), self.device)
        latents = noised(source, noise, schedule.sigmas[0])
        if params.mask is None:
            return latents, None
        mask = self.masks.preprocess(to_pil(params.mask), height=params.height,
                                     width=params.width)
        # (1, 1, H, W) -> (n, 1, h, w): nearest, as diffusers' prepare_mask_latents.
        mask = torch.nn.functional.interpolate(mask, size=latent_shape[2:], mode="nearest")
        mask = upload(mask, self.device).to(dtype).repeat(n, 1, 1, 1)
        return latents, Inpainting(source, noise, mask)
