"""GGUF files served by ditserve equal diffusers' own GGUF loading of the same quantized weights
(diffusers' FluxPipeline with a ``from_single_file`` GGUF transformer), within 1e-3 on [0, 1]
pixels, for Q8_0 and Q4_K; and streamed under layerwise offload they equal resident.

ditserve reads the BFL-named file ``model convert`` writes (city96's layout). diffusers 0.42's
Flux converter only reads the released width (3072), so its side reads a file of the same
quantized bytes under diffusers' names, which it loads without converting: GGUF quantizes each
row on its own, so q, k and v quantized apart are byte for byte the rows of the fused ``qkv``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from weights.support import wide_flux  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.formats.gguf_linear import GGUFBlockLinear
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.weights.convert import convert, write_gguf
from ditserve.engine.weights.loader import load_dit_state_dict

TOLERANCE = 1e-3  # fp32, pixels in [0, 1]
PARAMS = SamplingParams(prompt="a red cat", num_inference_steps=3, seed=7, guidance_scale=3.5)


@pytest.fixture(scope="module")
def wide_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wide_flux(tiny_model_dir, tmp_path_factory.mktemp("wide") / "flux")


def ditserve_images(model_dir: Path, checkpoint: Path, **changes: object) -> torch.Tensor:
    config = EngineConfig(model=str(model_dir), checkpoint=str(checkpoint),
                          device="cpu").replace(**changes)
    runner = ModelRunner(RunnerConfig.of(config), model_dir=model_dir)
    try:
        blocks = runner.pipeline.transformer.single_transformer_blocks  # type: ignore[attr-defined]
        assert isinstance(blocks[0].proj_out, GGUFBlockLinear)  # kept quantized
        return drive(runner, {0: [("r", PARAMS)]}, max_num_seqs=1)[0]["r"]
    finally:
        runner.close()


def diffusers_images(model_dir: Path, gguf_file: Path) -> torch.Tensor:
    from diffusers import FluxPipeline, FluxTransformer2DModel, GGUFQuantizationConfig

    transformer = FluxTransformer2DModel.from_single_file(
        str(gguf_file), config=str(model_dir), subfolder="transformer",
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        torch_dtype=torch.float32)
    pipe = FluxPipeline.from_pretrained(model_dir, transformer=transformer)
    out = pipe(PARAMS.prompt, height=PARAMS.height, width=PARAMS.width,
               num_inference_steps=PARAMS.num_inference_steps,
               guidance_scale=PARAMS.guidance_scale,
               generator=torch.Generator("cpu").manual_seed(PARAMS.seed), output_type="pt")
    return out.images.float()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_gguf_matches_diffusers_gguf_loading(wide_dir: Path, tmp_path: Path, qtype: str) -> None:
    ours_file = tmp_path / f"flux-{qtype}.gguf"
    report = convert(wide_dir, ours_file, to=f"gguf:{qtype}")
    assert report.quantized >= 14  # every block linear: 1 double + 1 single block
    theirs_file = tmp_path / f"flux-{qtype}-diffusers-names.gguf"
    write_gguf(load_dit_state_dict(wide_dir, dtype="float32"), theirs_file, qtype=qtype,
               arch="flux")
    ours = ditserve_images(wide_dir, ours_file)
    expected = diffusers_images(wide_dir, theirs_file)
    assert ours.shape == expected.shape
    diff = (ours - expected).abs().max().item()
    assert diff <= TOLERANCE, f"max abs diff {diff}"
    offloaded = ditserve_images(wide_dir, ours_file, offload=OffloadConfig(enabled=True))
    assert torch.equal(offloaded, ours)
