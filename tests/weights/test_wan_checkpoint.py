"""Wan checkpoint files in Wan's original key names (``model convert`` writes them as Wan-AI's,
Comfy-Org's and city96's files are), served with ``--model FILE --base-model WAN_DIR`` (tiny
Wan, CPU): a single file gives the folder's DiT bit for bit and the same videos; a GGUF Q8_0
or Q4_K file keeps its block linears quantized and equals diffusers' own GGUF loading of the
same file (``WanTransformer3DModel.from_single_file`` in a ``WanPipeline``) within 1e-3 on
[0, 1] pixels, every frame, and under layerwise offload equals resident (Q4_K on a 256-wide
DiT: K-quants need rows of 256 values; a layer whose rows do not fit stays F16 in the file and
loads as an ordinary linear, as for Flux); image-to-video and TI2V Q4_K DiTs equal diffusers'
GGUF DiTs; an FP8 file equals
``--quantization fp8``; a file of other shapes is refused naming the first mismatching key and
both shapes; Wan 2.2's two DiTs are refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from weights.support import (  # type: ignore[import-not-found]
    K_QUANT_WAN,
    align_folder_dits,
    wide_wan,
)

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.errors import ConfigError, ModelLoadError
from ditserve.engine.formats.gguf_linear import GGUFBlockLinear
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.weights.convert import convert

TOLERANCE = 1e-3  # fp32, pixels in [0, 1]
PARAMS = {
    "cat": SamplingParams(prompt="a red cat", num_inference_steps=3, seed=7,
                          guidance_scale=1.0, height=32, width=32, num_frames=5),
    "waves": SamplingParams(prompt="waves", negative_prompt="fog", num_inference_steps=2,
                            seed=3, guidance_scale=4.0, height=32, width=32, num_frames=5),
}


@pytest.fixture(scope="module")
def wan_dir(tiny_variant_dir: Callable[[str], Path]) -> Path:
    return tiny_variant_dir("wan")


@pytest.fixture(scope="module")
def wide_dir(wan_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wide_wan(wan_dir, tmp_path_factory.mktemp("wide-wan") / "wan")


@pytest.fixture(scope="module")
def k_quant_dir(wan_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wide_wan(wan_dir, tmp_path_factory.mktemp("k-quant-wan") / "wan", K_QUANT_WAN)


def generate(model_dir: Path, checkpoint: Path | None = None, names: tuple[str, ...] = ("cat",),
             **changes: object) -> dict[str, torch.Tensor]:
    config = EngineConfig(model=str(model_dir), checkpoint=None if checkpoint is None
                          else str(checkpoint), device="cpu").replace(**changes)
    runner = ModelRunner(RunnerConfig.of(config), model_dir=model_dir)
    try:
        return drive(runner, {0: [(n, PARAMS[n]) for n in names]}, max_num_seqs=2)[0]
    finally:
        runner.close()


@pytest.mark.parametrize("variant", ["wan", "wan-i2v", "wan2.2-ti2v"])
def test_single_file_gives_the_folders_dit_bit_for_bit(tiny_variant_dir: Callable[[str], Path],
                                                      tmp_path: Path, variant: str) -> None:
    from ditserve.engine.weights.dit_file import load_dit_file
    from ditserve.engine.weights.loader import load_dit

    model = tiny_variant_dir(variant)
    path = tmp_path / "wan.safetensors"
    convert(model, path, to="single-file")
    want = load_dit(model, dtype="float32").state_dict()
    got = load_dit_file(path, model, dtype="float32").state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_comfyui_prefixed_single_file_loads_too(wan_dir: Path, tmp_path: Path) -> None:
    """Comfy-Org's files put ``model.diffusion_model.`` before Wan's names."""
    from safetensors.torch import load_file, save_file

    from ditserve.engine.weights.checkpoint_file import inspect_checkpoint
    from ditserve.engine.weights.dit_file import load_dit_file
    from ditserve.engine.weights.loader import load_dit

    plain, prefixed = tmp_path / "wan.safetensors", tmp_path / "comfy.safetensors"
    convert(wan_dir, plain, to="single-file")
    save_file({f"model.diffusion_model.{k}": v for k, v in load_file(str(plain)).items()},
              str(prefixed))
    assert inspect_checkpoint(prefixed).family == "wan"
    want = load_dit(wan_dir, dtype="float32").state_dict()
    got = load_dit_file(prefixed, wan_dir, dtype="float32").state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_single_file_videos_equal_the_folders(wan_dir: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "wan.safetensors"
    convert(wan_dir, path, to="single-file")
    names = tuple(PARAMS)
    single = generate(wan_dir, path, names=names)
    folder = generate(wan_dir, names=names)
    assert folder.keys() == single.keys()
    for k in folder:
        assert folder[k].shape[:2] == (1, PARAMS[k].num_frames)  # (n, frames, 3, H, W)
        # Not bit for bit as is: this folder's own load leaves its tensors 8-byte aligned
        # (where each lies after safetensors' header), the file's load 64-byte aligned, and
        # CPU matmul kernels take another path for each (docs/formats.md) ...
        assert (folder[k] - single[k]).abs().max().item() < 1e-5, k
    # ... with the folder's DiT tensors each in an allocation of its own, as the file's load
    # gives them, the videos are the file's bit for bit.
    align_folder_dits(monkeypatch)
    aligned = generate(wan_dir, names=names)
    assert all(torch.equal(aligned[k], single[k]) for k in single)


def diffusers_video(model_dir: Path, gguf_file: Path, p: SamplingParams) -> torch.Tensor:
    from diffusers import GGUFQuantizationConfig, WanPipeline, WanTransformer3DModel

    transformer = WanTransformer3DModel.from_single_file(
        str(gguf_file), config=str(model_dir), subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(model_dir, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe(p.prompt, negative_prompt=p.negative_prompt, height=p.height, width=p.width,
                num_frames=p.num_frames, num_inference_steps=p.num_inference_steps,
                guidance_scale=p.guidance_scale,
                generator=torch.Generator("cpu").manual_seed(p.seed),
                output_type="pt").frames.float()


# bytes per block of values of each type tested (GGUF's block geometry)
BLOCK_BYTES = {"Q8_0": (32, 34), "Q4_K": (256, 144)}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_gguf_equals_diffusers_gguf_loading_and_streams_as_resident(
        qtype: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    model_dir: Path = request.getfixturevalue("wide_dir" if qtype == "Q8_0" else "k_quant_dir")
    path = tmp_path / f"wan-{qtype}.gguf"
    report = convert(model_dir, path, to=f"gguf:{qtype}")
    assert report.quantized >= 2 * 10  # every block linear of both blocks, and more
    config = EngineConfig(model=str(model_dir), checkpoint=str(path), device="cpu")
    runner = ModelRunner(RunnerConfig.of(config), model_dir=model_dir)
    try:
        dit = runner.pipeline.transformer  # type: ignore[attr-defined]
        block_linears = [m for m in dit.blocks.modules() if hasattr(m, "in_features")]
        assert len(block_linears) == 2 * 10
        assert all(isinstance(m, GGUFBlockLinear) and m.quant.name == qtype
                   for m in block_linears)
        values, nbytes = BLOCK_BYTES[qtype]
        layer = dit.blocks[1].attn1.to_q
        width = layer.in_features
        assert layer.weight_q.numel() == width * width // values * nbytes  # the file's blocks
        # the text embedder's first linear takes 32 inputs: no Q4_K rows, stored F16, loaded
        # as an ordinary linear in the engine's dtype (Q8_0's 32-value rows fit it)
        first = dit.condition_embedder.text_embedder.linear_1
        assert type(first) is torch.nn.Linear and first.weight.dtype == torch.float32
        resident = drive(runner, {0: [(n, PARAMS[n]) for n in PARAMS]}, max_num_seqs=2)[0]
    finally:
        runner.close()
    for name, p in PARAMS.items():
        expected = diffusers_video(model_dir, path, p)
        assert resident[name].shape == expected.shape == (1, p.num_frames, 3, p.height, p.width)
        # every frame
        diff = (resident[name] - expected).abs().amax(dim=(0, 2, 3, 4))
        assert diff.max().item() <= TOLERANCE, f"{name}: max abs diff per frame {diff.tolist()}"
        assert resident[name].std().item() > 1e-3  # not a constant video
    offloaded = generate(model_dir, path, names=tuple(PARAMS),
                         offload=OffloadConfig(enabled=True))
    assert all(torch.equal(offloaded[k], resident[k]) for k in resident)
    folder = generate(model_dir, names=tuple(PARAMS))
    assert any(not torch.equal(folder[k], resident[k]) for k in folder)  # it is quantized


def diffusers_gguf_dit(model_dir: Path, gguf_file: Path) -> torch.nn.Module:
    from diffusers import GGUFQuantizationConfig, WanTransformer3DModel

    return WanTransformer3DModel.from_single_file(
        str(gguf_file), config=str(model_dir), subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        torch_dtype=torch.float32).eval()


def test_q4_k_of_the_24_wide_tiny_wan_keeps_every_layer_in_a_wider_type(
        wan_dir: Path, tmp_path: Path) -> None:
    """No row of the default tiny Wan (24 wide, FFN 32) holds 256 values: a Q4_K file quantizes
    nothing (2-D weights of more than 1024 values F16, the rest F32, as for the 32-wide tiny
    Flux), and the DiT is diffusers' own load of that file, every layer an ordinary linear."""
    from ditserve.engine.weights.dit_file import load_dit_file

    path = tmp_path / "wan-Q4_K.gguf"
    assert convert(wan_dir, path, to="gguf:Q4_K").quantized == 0
    ours = load_dit_file(path, wan_dir, dtype="float32")
    assert not any(isinstance(m, GGUFBlockLinear) for m in ours.modules())
    want = diffusers_gguf_dit(wan_dir, path).state_dict()
    got = ours.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("variant", ["wan-i2v", "wan2.2-ti2v"])
def test_q4_k_image_to_video_dits_equal_diffusers_gguf_dits(
        variant: str, tiny_variant_dir: Callable[[str], Path], tmp_path: Path) -> None:
    """Wan 2.1 I2V (image keys and values in every block, an image embedder) and Wan 2.2 TI2V
    (48 latent channels), 256 wide: Q4_K keeps every block linear quantized and the DiT's
    output equals diffusers' GGUF DiT of the same file on the same inputs."""
    from ditserve.engine.weights.dit_file import load_dit_file

    model_dir = wide_wan(tiny_variant_dir(variant), tmp_path / variant, K_QUANT_WAN)
    path = tmp_path / f"{variant}-Q4_K.gguf"
    convert(model_dir, path, to="gguf:Q4_K")
    ours = load_dit_file(path, model_dir, dtype="float32")
    block_linears = [m for m in ours.blocks.modules() if hasattr(m, "in_features")]
    per_block = 12 if variant == "wan-i2v" else 10  # + add_k_proj, add_v_proj
    assert len(block_linears) == 2 * per_block
    assert all(isinstance(m, GGUFBlockLinear) and m.quant.name == "Q4_K" for m in block_linears)
    theirs = diffusers_gguf_dit(model_dir, path)
    config = ours.config
    generator = torch.Generator().manual_seed(5)
    inputs = {
        "hidden_states": torch.randn(1, config.in_channels, 2, 4, 4, generator=generator),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 8, config.text_dim, generator=generator),
    }
    if config.image_dim is not None:
        inputs["encoder_hidden_states_image"] = torch.randn(1, 4, config.image_dim,
                                                            generator=generator)
    with torch.no_grad():
        got = ours(**inputs, return_dict=False)[0]
        want = theirs(**inputs, return_dict=False)[0]
    assert got.shape == (1, config.out_channels, 2, 4, 4)
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5, f"max abs diff {diff}"


def test_fp8_file_equals_fp8_quantization(wide_dir: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "wan-fp8.safetensors"
    assert convert(wide_dir, path, to="fp8").quantized > 0
    from_file = generate(wide_dir, path)["cat"]
    align_folder_dits(monkeypatch)  # the tensors --quantization fp8 leaves as loaded
    assert torch.equal(from_file, generate(wide_dir, quantization="fp8")["cat"])


def test_file_of_other_shapes_is_refused_with_key_and_both_shapes(
        wan_dir: Path, wide_dir: Path, tmp_path: Path) -> None:
    from ditserve.engine.weights.dit_file import check_checkpoint

    path = tmp_path / "wide.safetensors"
    convert(wide_dir, path, to="single-file")
    assert check_checkpoint(path, wide_dir).family == "wan"
    with pytest.raises(ModelLoadError) as e:
        check_checkpoint(path, wan_dir)
    message = str(e.value)
    assert str(path) in message
    # the first tensor in the model's order whose shape differs, with both shapes
    assert "first mismatching tensor scale_shift_table is [1, 2, 64] in the file but " \
           "[1, 2, 24] in the model" in message


def test_wan22_two_dits_are_refused(tiny_variant_dir: Callable[[str], Path], wan_dir: Path,
                                    tmp_path: Path) -> None:
    from ditserve.engine.weights.load import load_weights

    experts = tiny_variant_dir("wan2.2")
    with pytest.raises(ConfigError, match="several DiTs"):
        convert(experts, tmp_path / "wan22.safetensors", to="single-file")
    one = tmp_path / "wan21.safetensors"
    convert(wan_dir, one, to="single-file")
    with pytest.raises(ModelLoadError, match="several DiTs"):
        load_weights(experts, dtype="float32", offload=OffloadConfig(), checkpoint=one)
