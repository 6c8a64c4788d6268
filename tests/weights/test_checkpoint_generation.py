"""Whole generations through the model runner from checkpoint files (tiny Flux, CPU): a
single file equals its diffusers folder bit for bit; a GGUF file serves with its linears still
quantized, resident and under layerwise offload alike (offloaded == resident); an FP8 file
serves through FP8 linears equal to ``--quantization fp8`` of the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.weights.convert import convert

ARRIVALS = {
    0: [("fox", SamplingParams(prompt="a red fox", num_inference_steps=2, seed=11)),
        ("cat", SamplingParams(prompt="a cat", num_inference_steps=3, seed=5))],
}


def generate(model_dir: Path, checkpoint: Path | None = None, **changes: object
             ) -> dict[str, torch.Tensor]:
    config = EngineConfig(model=str(model_dir), checkpoint=None if checkpoint is None
                          else str(checkpoint), device="cpu").replace(**changes)
    runner = ModelRunner(RunnerConfig.of(config), model_dir=model_dir)
    try:
        return drive(runner, ARRIVALS, max_num_seqs=2)[0]
    finally:
        runner.close()


@pytest.fixture(scope="module")
def files(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for to, name in (("single-file", "flux.safetensors"), ("gguf:Q8_0", "flux-Q8_0.gguf"),
                     ("fp8", "flux-fp8.safetensors")):
        out[to] = root / name
        convert(tiny_model_dir, out[to], to=to)
    return out


def test_single_file_generations_equal_the_folder_bit_for_bit(tiny_model_dir: Path,
                                                              files: dict[str, Path]) -> None:
    folder = generate(tiny_model_dir)
    single = generate(tiny_model_dir, files["single-file"])
    assert folder.keys() == single.keys()
    assert all(torch.equal(folder[k], single[k]) for k in folder)


def test_gguf_serves_quantized_and_offloaded_equals_resident(tiny_model_dir: Path,
                                                             files: dict[str, Path]) -> None:
    from ditserve.engine.formats.gguf_linear import GGUFBlockLinear

    config = EngineConfig(model=str(tiny_model_dir), checkpoint=str(files["gguf:Q8_0"]),
                          device="cpu")
    runner = ModelRunner(RunnerConfig.of(config), model_dir=tiny_model_dir)
    try:
        layer = runner.pipeline.transformer.transformer_blocks[0].ff.net[2]  # type: ignore[attr-defined]
        assert isinstance(layer, GGUFBlockLinear) and layer.weight_q.dtype == torch.uint8
        # still the file's Q8_0 blocks: 34 bytes per 32 weights
        assert layer.weight_q.numel() == layer.in_features * layer.out_features // 32 * 34
        resident = drive(runner, ARRIVALS, max_num_seqs=2)[0]
    finally:
        runner.close()
    offloaded = generate(tiny_model_dir, files["gguf:Q8_0"], offload=OffloadConfig(enabled=True))
    folder = generate(tiny_model_dir)
    assert all(torch.equal(offloaded[k], resident[k]) for k in resident)
    assert any(not torch.equal(resident[k], folder[k]) for k in folder)  # it is quantized
    assert all((resident[k].float() - folder[k].float()).abs().max() < 0.05 for k in folder)


def test_fp8_file_equals_fp8_quantization_resident_and_offloaded(
        tiny_model_dir: Path, files: dict[str, Path]) -> None:
    quantized = generate(tiny_model_dir, quantization="fp8")
    from_file = generate(tiny_model_dir, files["fp8"])
    offloaded = generate(tiny_model_dir, files["fp8"], offload=OffloadConfig(enabled=True))
    assert all(torch.equal(quantized[k], from_file[k]) for k in quantized)
    assert all(torch.equal(offloaded[k], from_file[k]) for k in quantized)


def test_qwen_image_single_file_equals_its_folder_bit_for_bit(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Another family than Flux (diffusers' names, no BFL mapping): a Qwen-Image single file
    gives its folder's DiT bit for bit and serves as the folder does, and its GGUF Q8_0 file
    streams under DLO equal to resident."""
    from ditserve.engine.makers.tiny_model import init_tiny

    root = tmp_path_factory.mktemp("qwen")
    model = init_tiny(root / "qwen-image", family="qwen-image")
    single, gguf = root / "qwen.safetensors", root / "qwen-Q8_0.gguf"
    convert(model, single, to="single-file")
    convert(model, gguf, to="gguf:Q8_0")
    from ditserve.engine.weights.dit_file import load_dit_file
    from ditserve.engine.weights.loader import load_dit

    want = load_dit(model, dtype="float32").state_dict()
    got = load_dit_file(single, model, dtype="float32").state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    folder = generate(model)
    from_file = generate(model, single)
    assert folder.keys() == from_file.keys()
    # Not bit for bit here: this folder's own load leaves its tensors 8-byte aligned (where
    # safetensors' header ends), the file's load 64-byte aligned, and CPU matmul kernels take
    # another path for each; the weights themselves are equal (above).
    assert all((folder[k] - from_file[k]).abs().max() < 1e-5 for k in folder)
    resident = generate(model, gguf)
    offloaded = generate(model, gguf, offload=OffloadConfig(enabled=True))
    assert all(torch.equal(resident[k], offloaded[k]) for k in resident)
