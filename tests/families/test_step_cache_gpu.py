"""The step cache on CUDA (run on the device machine): threshold 0 and every=1 give the uncached
pixels bit for bit (md5), resident and DLO, bf16 and fp32; a reused step under DLO copies no
streamed block; a batch mixing policies equals each request alone."""

from __future__ import annotations

import hashlib

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.config.step_cache import StepCacheSpec
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.step.plan import RunnerOutput

pytestmark = pytest.mark.gpu
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}


def params(variant: str, cache: StepCacheSpec | None, **over: object) -> SamplingParams:
    fields: dict[str, object] = {"prompt": "a lighthouse", "num_inference_steps": 8, "seed": 4,
                                 "height": 32, "width": 32, "step_cache": cache}
    if variant == "wan":
        fields.update(num_frames=5, guidance_scale=1.0)
    fields.update(over)
    return SamplingParams(**fields)  # type: ignore[arg-type]


def md5(pixels: torch.Tensor) -> str:
    return hashlib.md5(pixels.numpy().tobytes()).hexdigest()


def runner(model, *, dlo: bool, dtype: str) -> ModelRunner:  # type: ignore[no-untyped-def]
    offload = OffloadConfig(enabled=True, checkpoint_mmap="off") if dlo else OffloadConfig()
    return ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cuda", dtype=dtype,
                                                    offload=offload)), model_dir=model)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dlo", [False, True], ids=["resident", "dlo"])
@pytest.mark.parametrize("variant", ["flux", "qwen-image", "wan"])
def test_off_equivalent_settings_are_identical_on_cuda(family_dir, variant: str, dlo: bool,
                                                       dtype: str) -> None:  # type: ignore[no-untyped-def]
    r = runner(family_dir(variant), dlo=dlo, dtype=dtype)
    try:
        plain, _ = drive(r, {0: [("plain", params(variant, None))]}, max_num_seqs=1)
        for spec in (StepCacheSpec("first-block", threshold=0.0), StepCacheSpec("every", every=1)):
            got, _ = drive(r, {0: [("c", params(variant, spec))]}, max_num_seqs=1)
            assert md5(got["c"]) == md5(plain["plain"]), spec
    finally:
        r.close()


def test_reused_steps_copy_nothing_and_batches_equal_alone_on_cuda(family_dir) -> None:  # type: ignore[no-untyped-def]
    r = runner(family_dir("flux"), dlo=True, dtype="bfloat16")
    arrivals = {0: [("every", params("flux", StepCacheSpec("every", every=2)))],
                1: [("fb", params("flux", StepCacheSpec("first-block", threshold=0.5), seed=6)),
                    ("plain", params("flux", None, seed=8, num_inference_steps=5))]}
    try:
        outputs: list[RunnerOutput] = []
        alone, _ = drive(r, {0: arrivals[0]}, max_num_seqs=1, outputs=outputs)
        reused = [o for o in outputs if o.step_cache_skipped_blocks]
        assert reused and all(o.step_cache_skipped_bytes > 0 for o in reused)
        batched, _ = drive(r, arrivals, max_num_seqs=4)
        for rid, p in arrivals[1]:
            solo, _ = drive(r, {0: [(f"solo-{rid}", p)]}, max_num_seqs=1)
            diff = (batched[rid] - solo[f"solo-{rid}"]).abs().max().item()
            assert diff <= TOLERANCE["bfloat16"], (rid, diff)
        diff = (batched["every"] - alone["every"]).abs().max().item()
        assert diff <= TOLERANCE["bfloat16"], diff
    finally:
        r.close()
