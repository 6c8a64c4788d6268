"""Helpers for offload tests: tiny diffusers Flux transformers built in code, and inputs."""

from __future__ import annotations

import torch


def build_flux(*, num_layers: int = 3, num_single_layers: int = 2, seed: int = 0, **overrides):  # type: ignore[no-untyped-def]
    """A tiny random FluxTransformer2DModel (fp32, eval). 3 + 2 blocks: an odd count."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    kwargs = dict(
        patch_size=1, in_channels=16, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=32, axes_dims_rope=(4, 6, 6),
    )
    kwargs.update(overrides)
    model: torch.nn.Module = FluxTransformer2DModel(**kwargs)  # type: ignore[assignment]
    return model.eval()


def flux_inputs(batch: int, *, seed: int = 1, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, tokens: int = 16, text: int = 8):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    return dict(
        hidden_states=rand(batch, tokens, 16),
        encoder_hidden_states=rand(batch, text, 32),
        pooled_projections=rand(batch, 32),
        timestep=torch.rand(batch, generator=g).to(device=device, dtype=dtype),
        img_ids=torch.zeros(tokens, 3, device=device),
        txt_ids=torch.zeros(text, 3, device=device),
        return_dict=False,
    )


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:  # type: ignore[type-arg]
    with torch.inference_mode():
        return model(**inputs)[0]


def holds_storage(tensor: torch.Tensor) -> bool:
    """False for an offload placeholder (a zero-stride view of one element)."""
    return tensor.numel() <= 1 or tensor.untyped_storage().nbytes() >= tensor.numel() * tensor.element_size()


def steady_steps_without_sync(model: torch.nn.Module, inputs: dict, *, steps: int = 3) -> None:  # type: ignore[type-arg]
    """One cold step, then ``steps`` more with CUDA's sync debug mode at "error": any call in
    them that synchronizes the host with the device raises."""
    run(model, inputs)  # cold step (first loads, a kernel's first compile)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            run(model, inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
