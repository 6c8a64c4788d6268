"""Preemption on CUDA under DLO (run on the device): a request paused at a step boundary - its
denoise state parked on the GPU while another request streams every block through the slots -
resumes to exactly the output of an uninterrupted run, with the runner's one-step-late
pipelining (a pause lands while the paused request's previous step may still be queued)."""

from __future__ import annotations

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from engine.test_preemption import BATCH, URGENT, paused_and_resumed  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.runner.model_runner import ModelRunner

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["resident", "dlo"])
def cuda_runner(tiny_model_dir, request):  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    offload = OffloadConfig(enabled=request.param == "dlo")
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cuda",
                                                      offload=offload)),
                         model_dir=tiny_model_dir)
    yield runner
    runner.close()


def test_resumed_output_on_cuda_equals_an_uninterrupted_run(cuda_runner) -> None:  # type: ignore[no-untyped-def]
    pixels, plans = paused_and_resumed(cuda_runner)
    assert any("batch" not in p.denoise and "urgent" in p.denoise for p in plans)
    alone, _ = drive(cuda_runner, {0: [("x", BATCH)]}, max_num_seqs=1)
    assert torch.equal(pixels["batch"], alone["x"])
    urgent_alone, _ = drive(cuda_runner, {0: [("x", URGENT)]}, max_num_seqs=1)
    assert torch.equal(pixels["urgent"], urgent_alone["x"])
