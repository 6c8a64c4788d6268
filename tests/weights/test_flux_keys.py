"""Flux's BFL <-> diffusers key mapping: ``to_diffusers`` gives exactly what diffusers' own
single-file converter gives at the released shapes, ``to_bfl`` is its inverse, and a tiny
(narrow) Flux round-trips, which diffusers' converter cannot read."""

from __future__ import annotations

import torch

from ditserve.engine.weights.flux_keys import is_bfl, is_diffusers, to_bfl, to_diffusers


def cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=0)


def released_state(columns: int = 1) -> dict[str, torch.Tensor]:
    """A diffusers Flux state dict at FLUX.1-dev's row counts (2 + 2 blocks), each 2-D tensor
    ``columns`` wide (every mapping step is along rows), with distinct values."""
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel

    with init_empty_weights():
        model = FluxTransformer2DModel(num_layers=2, num_single_layers=2, guidance_embeds=True)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name, t in model.state_dict().items():
        shape = (t.shape[0], columns) if t.dim() == 2 else tuple(t.shape)
        out[name] = torch.randn(shape, generator=gen)
    return out


def test_to_diffusers_equals_diffusers_converter_at_released_shapes() -> None:
    from diffusers.loaders.single_file_utils import (
        convert_flux_transformer_checkpoint_to_diffusers,
    )

    state = released_state()
    bfl = to_bfl(state, cat=cat)
    assert is_bfl(bfl) and not is_diffusers(bfl) and is_diffusers(state)
    theirs = convert_flux_transformer_checkpoint_to_diffusers(dict(bfl))
    ours = to_diffusers(bfl, cat=cat)
    assert ours.keys() == theirs.keys() == state.keys()
    for key in state:
        assert torch.equal(ours[key], theirs[key]), key
        assert torch.equal(ours[key], state[key]), key


def test_prefixed_bfl_names_map_too() -> None:
    state = released_state()
    bfl = {f"model.diffusion_model.{k}": v for k, v in to_bfl(state, cat=cat).items()}
    ours = to_diffusers(bfl, cat=cat)
    assert all(torch.equal(ours[k], state[k]) for k in state)


def test_narrow_flux_round_trips(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.weights.loader import load_dit_state_dict

    state = load_dit_state_dict(tiny_model_dir, dtype="float32")
    back = to_diffusers(to_bfl(state, cat=cat), cat=cat)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
