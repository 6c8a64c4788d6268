"""On CUDA, engine steps queue their work without waiting for the GPU (run on the device).

A host sync between steps leaves the GPU idle while the host prepares the next step; with
layerwise offload it also stalls the copy engine. Steps that only denoise, and steps that admit
a request next to a running one, must not sync; only a decode (pixels to the host) may.
"""

from __future__ import annotations

import pytest
import torch

from ditserve.engine.config import EngineConfig, SchedulerConfig
from ditserve.engine.model_runner import ModelRunner
from ditserve.engine.request import SamplingParams
from ditserve.engine.scheduler import StepScheduler

pytestmark = pytest.mark.gpu


def test_denoise_and_admission_steps_do_not_sync(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    runner = ModelRunner(EngineConfig(model=str(tiny_model_dir), device="cuda"),
                         model_dir=tiny_model_dir)
    scheduler = StepScheduler(SchedulerConfig(max_num_seqs=2))

    def step(new: list[tuple[str, SamplingParams]]) -> None:
        for rid, params in new:
            scheduler.add(rid, params)
        plan = scheduler.schedule()
        assert not plan.decode, "this test only covers steps without a decode"
        output = runner.execute(plan, [(rid, p, p.seed or 0) for rid, p in new])
        assert not output.failed, output.failed
        scheduler.update(plan, output)

    step([("a", SamplingParams(prompt="a", num_inference_steps=8, seed=1))])  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        step([])  # denoise only
        step([("b", SamplingParams(prompt="b", num_inference_steps=8, seed=2))])  # admission
        step([])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
