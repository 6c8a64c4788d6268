"""Wan's original <-> diffusers key mapping (``weights.wan_keys``): one table that round-trips
exactly, and whose original names diffusers' own converter
(``convert_wan_transformer_to_diffusers``) maps back to the diffusers folder's tensors - for
Wan 2.1 text-to-video and image-to-video and Wan 2.2 TI2V, and for the files ``model convert`` writes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ditserve.engine.weights.wan_keys import is_original, to_diffusers, to_original


@pytest.fixture(scope="module")
def wan_dirs(tiny_variant_dir: Callable[[str], Path]) -> dict[str, Path]:
    return {v: tiny_variant_dir(v) for v in ("wan", "wan-i2v", "wan2.2-ti2v")}


def folder_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from ditserve.engine.weights.loader import load_dit_state_dict

    return load_dit_state_dict(model_dir, dtype="float32")


@pytest.mark.parametrize("variant", ["wan", "wan-i2v", "wan2.2-ti2v"])
def test_table_round_trips_and_diffusers_reads_its_names(wan_dirs: dict[str, Path],
                                                        variant: str) -> None:
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    state = folder_state(wan_dirs[variant])
    original = to_original(state)
    assert is_original(original) and not is_original(state)
    # Wan's own names (as Wan-AI's and Comfy-Org's files spell them)
    for name in ("patch_embedding.weight", "text_embedding.0.weight", "time_embedding.2.bias",
                 "time_projection.1.weight", "head.head.weight", "head.modulation",
                 "blocks.1.self_attn.q.weight", "blocks.0.cross_attn.o.bias",
                 "blocks.0.norm3.weight", "blocks.0.ffn.2.weight", "blocks.1.modulation"):
        assert name in original, name
    if variant == "wan-i2v":
        assert {"img_emb.proj.1.weight", "blocks.0.cross_attn.k_img.weight",
                "blocks.0.cross_attn.norm_k_img.weight"} <= original.keys()
    back = to_diffusers(original)
    assert back.keys() == state.keys()
    assert all(back[k] is state[k] for k in state)
    prefixed = to_diffusers({f"model.diffusion_model.{k}": v for k, v in original.items()})
    assert prefixed.keys() == state.keys()
    theirs = convert_wan_transformer_to_diffusers(dict(original))
    assert theirs.keys() == state.keys()
    assert all(torch.equal(theirs[k], state[k]) for k in state)


def test_unknown_tensor_has_no_original_name() -> None:
    with pytest.raises(KeyError, match="vace_blocks.0.proj_out.weight"):
        to_original({"vace_blocks.0.proj_out.weight": torch.zeros(1)})


@pytest.mark.parametrize("to", ["single-file", "gguf:Q8_0"])
def test_converted_file_is_in_original_names_diffusers_maps_back(
        wan_dirs: dict[str, Path], tmp_path: Path, to: str) -> None:
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from ditserve.engine.weights.checkpoint_file import inspect_checkpoint
    from ditserve.engine.weights.convert import convert

    model = wan_dirs["wan-i2v"]
    path = tmp_path / ("wan.gguf" if to.startswith("gguf") else "wan.safetensors")
    convert(model, path, to=to)
    info = inspect_checkpoint(path)
    assert info.family == "wan" and is_original(info.tensors)
    state = folder_state(model)
    if to == "single-file":
        from safetensors.torch import load_file

        theirs = convert_wan_transformer_to_diffusers(load_file(str(path)))
        assert theirs.keys() == state.keys()
        assert all(torch.equal(theirs[k], state[k]) for k in state)
        return
    import gguf
    from diffusers.models.model_loading_utils import load_gguf_checkpoint

    field = gguf.GGUFReader(path).get_field("general.architecture")
    assert field is not None and bytes(field.parts[field.data[-1]]).decode() == "wan"

    theirs = convert_wan_transformer_to_diffusers(load_gguf_checkpoint(str(path)))
    assert theirs.keys() == state.keys()
    # GGUF reports each tensor's logical shape; the 5-D patch embedding stays F32 (as
    # city96's Wan files keep it), so diffusers reads it back exactly
    assert all(info.tensors[to_original({k: 0}).popitem()[0]].shape == tuple(state[k].shape)
               for k in state)
    assert info.tensors["patch_embedding.weight"].dtype == "F32"
    assert torch.equal(theirs["patch_embedding.weight"], state["patch_embedding.weight"])
