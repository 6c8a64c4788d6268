"""Small pieces every step-wise pipeline uses: host-to-device uploads and seeded noise.

Both exist so that a pipeline never syncs the host: on CUDA the runner queues a whole step
while the previous one runs, and a copy from pageable memory would wait for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on the device without a host sync: a copy from pageable memory blocks
    until the GPU has drained everything queued before it (a whole DiT step while another
    request denoises); from pinned memory it is queued like a kernel."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def seeded_noise(
    shape: Sequence[int], *, seed: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The initial latents exactly as diffusers draws them for a CPU generator with ``seed``:
    on the CPU, in ``dtype``, then moved to the device."""
    generator = torch.Generator("cpu").manual_seed(seed)
    return upload(torch.randn(tuple(shape), generator=generator, dtype=dtype), device)


def first_parameter_dtype(module: torch.nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def latent_statistics(vae: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's per-channel latent mean and 1/std, (1, C, 1, 1, 1), on the device in the
    VAE's dtype, computed as diffusers computes them (the reciprocal in float32, then cast).
    Made once at load: a per-decode upload would be a host sync on CUDA."""
    config = vae.config
    shape = (1, int(config.z_dim), 1, 1, 1)
    dtype = next(vae.parameters()).dtype
    mean = torch.tensor(config.latents_mean).view(shape).to(device, dtype)
    inv_std = (1.0 / torch.tensor(config.latents_std).view(shape)).to(device, dtype)
    return mean, inv_std


def decode_normalized_video(vae: Any, latents: torch.Tensor, mean: torch.Tensor,
                            inv_std: torch.Tensor) -> torch.Tensor:
    """A Wan-VAE video's pixels, (n, F, 3, H, W) in [0, 1] on the host (copied without a
    sync): ``latents`` (n, C, f, h, w) normalized by ``latent_statistics``'s mean and 1/std."""
    latents = latents.to(vae.dtype) / inv_std + mean
    video = vae.decode(latents, return_dict=False)[0]  # (n, 3, F, H, W) in [-1, 1]
    pixels = (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
    return pixels.contiguous().to("cpu", non_blocking=True)
