"""The image-conditioned families (FLUX.1 Kontext, Qwen-Image-Edit and Plus, Wan I2V) on CUDA
(run on the device machine): with DLO (copy stream, two slots) two requests with different
input images, admitted together, equal resident exactly, and resident CUDA equals the CPU run
within float tolerance."""

from __future__ import annotations

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from families.test_image_conditioned import picture  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner

pytestmark = pytest.mark.gpu

VIDEO = {"flux-kontext": {}, "wan-i2v": {"num_frames": 5, "guidance_scale": 3.0},
         "wan2.2-ti2v-i2v": {"num_frames": 5, "guidance_scale": 1.0},
         # true CFG (a negative prompt): the CFG rows ride in the same forward
         "qwen-image-edit": {"negative_prompt": "blurry", "true_cfg_scale": 3.0},
         "qwen-image-edit-plus": {"negative_prompt": " ", "true_cfg_scale": 2.0}}


def arrivals(variant: str) -> dict[int, list[tuple[str, SamplingParams]]]:
    extra = VIDEO[variant]
    return {0: [(rid, SamplingParams(prompt=f"request {rid}", height=64, width=64, seed=seed,
                                     num_inference_steps=3, images=(picture(96, 80, seed),),
                                     **extra))
                for rid, seed in (("a", 1), ("b", 2))]}


@pytest.mark.parametrize("variant", sorted(VIDEO))
def test_dlo_on_cuda_equals_resident(family_dir, variant: str) -> None:  # type: ignore[no-untyped-def]
    model = family_dir(variant)
    runs = {}
    for name, offload in (("cpu", None), ("resident", None), ("dlo", OffloadConfig(
            enabled=True, checkpoint_mmap="off"))):
        device = "cpu" if name == "cpu" else "cuda"
        config = EngineConfig(model=str(model), device=device,
                              **({"offload": offload} if offload else {}))
        runner = ModelRunner(RunnerConfig.of(config), model_dir=model)
        try:
            runs[name], sizes = drive(runner, arrivals(variant), max_num_seqs=2)
        finally:
            runner.close()
        assert max(sizes) == 2
    for rid in runs["resident"]:
        assert torch.equal(runs["dlo"][rid], runs["resident"][rid]), rid
        assert (runs["resident"][rid] - runs["cpu"][rid]).abs().max().item() < 1e-2, rid
