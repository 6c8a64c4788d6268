"""FLUX.2 ([dev] and [klein]: one DiT class) and Z-Image checkpoint files in their original
key names (BFL's for FLUX.2, Tongyi-MAI's for Z-Image; ``model convert`` writes them as the
community's single files and city96-style GGUF files are), served with ``--model FILE
--base-model DIR`` on the tiny models (CPU): the key tables invert diffusers' converters at the
released shapes; a single file (ComfyUI-prefixed too) gives the folder's DiT, and images bit for
bit; GGUF Q8_0 (tiny) and Q4_K (256 wide) keep the block linears quantized, equal diffusers'
own GGUF loading of the same file inside diffusers' pipeline within 1e-3 on [0, 1] pixels, and
stream under layerwise offload equal to resident; an FP8 file loads as FP8 layers; a file of another width is refused
naming the first mismatching tensor and both shapes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from weights.support import (  # type: ignore[import-not-found]
    K_QUANT_DITS,
    align_folder_dits,
    widened,
)

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.errors import ModelLoadError
from ditserve.engine.formats.fp8_linear import FP8Linear
from ditserve.engine.formats.gguf_linear import GGUFBlockLinear
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.weights.convert import convert

TOLERANCE = 1e-3  # fp32, pixels in [0, 1]
FAMILIES = ("flux2", "flux2-klein", "z-image")
# The family the file's keys name: [klein] is FLUX.2's DiT.
FILE_FAMILY = {"flux2": "flux2", "flux2-klein": "flux2", "z-image": "z-image"}
PARAMS = {
    "flux2": SamplingParams(prompt="a red cat", num_inference_steps=2, seed=7,
                            guidance_scale=3.5, height=32, width=32),
    "flux2-klein": SamplingParams(prompt="a red cat", num_inference_steps=2, seed=7,
                                  guidance_scale=4.0, height=32, width=32),
    "z-image": SamplingParams(prompt="a red cat", num_inference_steps=2, seed=7,
                              guidance_scale=0.0, height=32, width=32),
}


def generate(model_dir: Path, family: str, checkpoint: Path | None = None,
             **changes: object) -> torch.Tensor:
    config = EngineConfig(model=str(model_dir), checkpoint=None if checkpoint is None
                          else str(checkpoint), device="cpu").replace(**changes)
    runner = ModelRunner(RunnerConfig.of(config), model_dir=model_dir)
    try:
        return drive(runner, {0: [("x", PARAMS[family])]}, max_num_seqs=1)[0]["x"]
    finally:
        runner.close()


def diffusers_images(model_dir: Path, family: str, gguf_file: Path) -> torch.Tensor:
    """diffusers' own pipeline with its own GGUF loading of ``gguf_file``."""
    import diffusers
    from diffusers import GGUFQuantizationConfig

    dit = diffusers.ZImageTransformer2DModel if family == "z-image" \
        else diffusers.Flux2Transformer2DModel
    transformer = dit.from_single_file(
        str(gguf_file), config=str(model_dir), subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        torch_dtype=torch.float32)
    pipe_class = {"flux2": diffusers.Flux2Pipeline, "flux2-klein": diffusers.Flux2KleinPipeline,
                  "z-image": diffusers.ZImagePipeline}[family]
    pipe = pipe_class.from_pretrained(model_dir, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    p = PARAMS[family]
    return pipe(prompt=p.prompt, height=p.height, width=p.width,
                num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                generator=torch.Generator("cpu").manual_seed(p.seed or 0),
                output_type="pt").images.float()


def original_names(family: str, state: dict[str, Any]) -> dict[str, Any]:
    from ditserve.engine.weights import flux2_keys, z_image_keys

    module: Any = z_image_keys if family == "z-image" else flux2_keys
    return module.to_original(state, cat=lambda parts: torch.cat(parts, dim=0))


def diffusers_converter(family: str, checkpoint: dict[str, Any]) -> dict[str, Any]:
    from diffusers.loaders import single_file_utils as utils

    convert_fn = utils.convert_z_image_transformer_checkpoint_to_diffusers \
        if family == "z-image" else utils.convert_flux2_transformer_checkpoint_to_diffusers
    return dict(convert_fn(dict(checkpoint)))


@pytest.mark.parametrize("family", ["flux2", "z-image"])
def test_tables_invert_diffusers_converters_at_released_shapes(family: str) -> None:
    """The released DiTs (FLUX.2 [dev]: 6144 wide, 8 + 48 blocks; Z-Image-Turbo: 3840 wide,
    30 + 2 + 2 layers) on the meta device: diffusers' converter, given the original names
    ``model convert`` writes, gives back every tensor under its name with its shape."""
    import diffusers
    from accelerate import init_empty_weights

    from ditserve.engine.weights.checkpoint_file import family_of_keys

    cls = diffusers.ZImageTransformer2DModel if family == "z-image" \
        else diffusers.Flux2Transformer2DModel
    with init_empty_weights():
        model = cls()  # diffusers' defaults are the released configs
    state = model.state_dict()
    original = original_names(family, state)
    assert family_of_keys(original) == family == family_of_keys(state)
    back = diffusers_converter(family, original)
    assert back.keys() == state.keys()
    assert all(back[k].shape == state[k].shape for k in state)
    # ComfyUI-style prefixed names are the same family
    assert family_of_keys({f"model.diffusion_model.{k}" for k in original}) == family


@pytest.mark.parametrize("family", FAMILIES)
def test_single_file_gives_the_folders_dit_and_images_bit_for_bit(
        family: str, tiny_variant_dir: Callable[[str], Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file

    from ditserve.engine.weights.checkpoint_file import inspect_checkpoint
    from ditserve.engine.weights.dit_file import load_dit_file
    from ditserve.engine.weights.loader import load_dit

    model_dir = tiny_variant_dir(family)
    path = tmp_path / "dit.safetensors"
    convert(model_dir, path, to="single-file")
    assert inspect_checkpoint(path).family == FILE_FAMILY[family]
    want = load_dit(model_dir, dtype="float32").state_dict()
    # the tiny tensors by value: diffusers' converter reads what convert wrote
    back = diffusers_converter(FILE_FAMILY[family], load_file(str(path)))
    assert back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)
    got = load_dit_file(path, model_dir, dtype="float32").state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    images = generate(model_dir, family, path)
    # the folder's DiT tensors each in an allocation of its own, as the file's load gives them
    # (the tiny Z-Image folder's own load leaves them 8-byte aligned: last-bit differences)
    align_folder_dits(monkeypatch)
    assert torch.equal(images, generate(model_dir, family))


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_file_loads_as_fp8_layers(family: str, tiny_variant_dir: Callable[[str], Path],
                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ditserve.engine.weights.dit_file import load_dit_file

    model_dir = tiny_variant_dir(family)
    path = tmp_path / "dit-fp8.safetensors"
    report = convert(model_dir, path, to="fp8")
    dit = load_dit_file(path, model_dir, dtype="float32")
    assert sum(isinstance(m, FP8Linear) for m in dit.modules()) == report.quantized > 0
    images = generate(model_dir, family, path)
    align_folder_dits(monkeypatch)  # the tensors --quantization fp8 leaves as loaded
    assert torch.equal(images, generate(model_dir, family, quantization="fp8"))


@pytest.mark.parametrize(("family", "qtype"), [
    ("flux2", "Q8_0"), ("flux2-klein", "Q8_0"), ("z-image", "Q8_0"),
    ("flux2", "Q4_K"), ("z-image", "Q4_K")])
def test_gguf_equals_diffusers_gguf_loading_and_streams_as_resident(
        family: str, qtype: str, tiny_variant_dir: Callable[[str], Path], tmp_path: Path) -> None:
    model_dir = tiny_variant_dir(family)
    if qtype == "Q4_K":
        model_dir = widened(model_dir, tmp_path / "wide", K_QUANT_DITS[FILE_FAMILY[family]])
    path = tmp_path / f"dit-{qtype}.gguf"
    report = convert(model_dir, path, to=f"gguf:{qtype}")
    assert report.quantized > 0
    from ditserve.engine.weights.dit_file import load_dit_file

    dit = load_dit_file(path, model_dir, dtype="float32")
    quantized = [m for m in dit.modules() if isinstance(m, GGUFBlockLinear)]
    assert quantized and all(m.quant.name == qtype for m in quantized)
    if qtype == "Q4_K":  # every block linear but Z-Image's 682-input w2 (stored F16)
        block_linears = [n for n, m in dit.named_modules()
                         if hasattr(m, "in_features") and n.split(".")[0] in
                         ("transformer_blocks", "single_transformer_blocks", "noise_refiner",
                          "context_refiner", "layers")]
        unquantized = [n for n in block_linears
                       if not isinstance(dit.get_submodule(n), GGUFBlockLinear)]
        assert all(n.endswith("feed_forward.w2") for n in unquantized), unquantized
    del dit
    resident = generate(model_dir, family, path)
    expected = diffusers_images(model_dir, family, path)
    assert resident.shape == expected.shape
    diff = (resident - expected).abs().max().item()
    assert diff <= TOLERANCE, f"max abs diff {diff}"
    assert resident.std().item() > 1e-3  # not a flat image
    offloaded = generate(model_dir, family, path, offload=OffloadConfig(enabled=True))
    assert torch.equal(offloaded, resident)


@pytest.mark.parametrize("family", ["flux2", "z-image"])
def test_file_of_another_width_is_refused_with_key_and_both_shapes(
        family: str, tiny_variant_dir: Callable[[str], Path], tmp_path: Path) -> None:
    from ditserve.engine.weights.dit_file import check_checkpoint

    model_dir = tiny_variant_dir(family)
    wide = widened(model_dir, tmp_path / "wide", K_QUANT_DITS[family])
    path = tmp_path / "wide.safetensors"
    convert(wide, path, to="single-file")
    assert check_checkpoint(path, wide).family == family
    with pytest.raises(ModelLoadError) as e:
        check_checkpoint(path, model_dir)
    message = str(e.value)
    assert str(path) in message
    # the first tensor in the model's order whose shape differs, with both shapes
    assert REFUSAL[family] in message, message


REFUSAL = {
    "flux2": "first mismatching tensor time_guidance_embed.timestep_embedder.linear_1.weight "
             "is [256, 32] in the file but [32, 32] in the model",
    "z-image": "first mismatching tensor x_pad_token is [1, 256] in the file but [1, 32] in "
               "the model",
}


@pytest.mark.parametrize("family", ["flux2", "z-image"])
def test_comfyui_prefixed_single_file_loads_too(family: str,
                                                tiny_variant_dir: Callable[[str], Path],
                                                tmp_path: Path) -> None:
    """ComfyUI's files put ``model.diffusion_model.`` before the original names (FLUX.2's
    converter does not strip it: ``map_keys`` does)."""
    from safetensors.torch import load_file, save_file

    from ditserve.engine.weights.checkpoint_file import inspect_checkpoint
    from ditserve.engine.weights.dit_file import load_dit_file
    from ditserve.engine.weights.loader import load_dit

    model_dir = tiny_variant_dir(family)
    plain, prefixed = tmp_path / "plain.safetensors", tmp_path / "comfy.safetensors"
    convert(model_dir, plain, to="single-file")
    save_file({f"model.diffusion_model.{k}": v for k, v in load_file(str(plain)).items()},
              str(prefixed))
    assert inspect_checkpoint(prefixed).family == family
    want = load_dit(model_dir, dtype="float32").state_dict()
    got = load_dit_file(prefixed, model_dir, dtype="float32").state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
