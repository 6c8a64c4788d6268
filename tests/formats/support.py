"""Shared helpers of the formats tests: a tiny random Flux transformer and its inputs."""

from __future__ import annotations

import torch
from torch import nn

from ditserve.engine.families.flux import TINY_DIT as TINY_TRANSFORMER


def tiny_flux() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(**TINY_TRANSFORMER).eval()  # type: ignore[arg-type]


def flux_inputs(model: nn.Module, img: int = 64, txt: int = 16) -> dict[str, object]:
    g = torch.Generator().manual_seed(2)
    c = model.config  # type: ignore[attr-defined]
    return dict(
        hidden_states=torch.randn(1, img, c.in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, txt, c.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(1, c.pooled_projection_dim, generator=g),
        timestep=torch.tensor([0.6]), guidance=torch.tensor([3.5]),
        img_ids=torch.zeros(img, 3), txt_ids=torch.zeros(txt, 3), return_dict=False)
