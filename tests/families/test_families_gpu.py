"""The families on CUDA (run on the device machine): DLO (copy stream, pinned slabs, one set of
slots for Wan 2.2's experts) equals resident exactly, alone and in batches that straddle the
Wan 2.2 boundary; the video path and the text masks run on the device."""

from __future__ import annotations

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from families.family_support import true_cfg  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner

pytestmark = pytest.mark.gpu


def arrivals(variant: str) -> dict[int, list[tuple[str, SamplingParams]]]:
    video = variant.startswith("wan")
    common = {"height": 32, "width": 32, **({"num_frames": 5} if video else {})}
    return {
        0: [("long", SamplingParams(prompt="a red fox in the snow", seed=1, guidance_scale=1.0,
                                    num_inference_steps=6, **common))],
        2: [("cfg", SamplingParams(prompt="a castle", negative_prompt="fog", seed=2,
                                   guidance_scale=3.0, num_inference_steps=3, **common,
                                   **true_cfg(variant)))],
    }


@pytest.mark.parametrize("variant", ["qwen-image", "wan", "wan2.2", "z-image", "flux2", "flux2-klein"])
def test_dlo_on_cuda_equals_resident(family_dir, variant: str) -> None:  # type: ignore[no-untyped-def]
    model = family_dir(variant)
    resident = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cuda")),
                           model_dir=model)
    want, sizes = drive(resident, arrivals(variant), max_num_seqs=2)
    resident.close()
    del resident
    offloaded = ModelRunner(
        RunnerConfig.of(EngineConfig(model=str(model), device="cuda",
                                     offload=OffloadConfig(enabled=True, checkpoint_mmap="off"))),
        model_dir=model)
    try:
        report = offloaded.offload_report()
        assert report["transfer"] == "cuda-copy-stream" and report["slots"] == 2
        got, got_sizes = drive(offloaded, arrivals(variant), max_num_seqs=2)
    finally:
        offloaded.close()
    assert got_sizes == sizes and max(sizes) == 2
    for rid in want:
        assert got[rid].device.type == "cpu"
        assert torch.equal(got[rid], want[rid]), rid
