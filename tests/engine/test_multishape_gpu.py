"""Multi-shape steps on CUDA under DLO (run on the device): shape groups run block-major on the
copy stream's schedule without a host sync, and each request equals its output alone.

The lanes (engine/block_major.py) share the thread and so the compute stream; a block's slot
is overwritten only after the last group's read (its free event), which a missing wait would
turn into wrong pixels here, not on the CPU (where copies are synchronous).
"""

from __future__ import annotations

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.step.plan import RunnerOutput

pytestmark = pytest.mark.gpu

REQUESTS = {
    "square": SamplingParams(prompt="a red fox", height=64, width=64, num_inference_steps=4,
                             seed=1),
    "wide": SamplingParams(prompt="a castle", negative_prompt="blurry", true_cfg_scale=3.0,
                           height=32, width=64, num_inference_steps=3, seed=2),
    "small": SamplingParams(prompt="sea", height=48, width=48, num_inference_steps=3, seed=3,
                            num_images=2),
}


@pytest.fixture(scope="module")
def dlo_cuda(tiny_model_dir):  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cuda",
                                                      offload=OffloadConfig(enabled=True))),
                         model_dir=tiny_model_dir)
    yield runner
    runner.close()


def test_block_major_groups_on_cuda_equal_alone_without_host_syncs(dlo_cuda) -> None:  # type: ignore[no-untyped-def]
    alone = {}
    for rid, params in REQUESTS.items():
        pixels, _ = drive(dlo_cuda, {0: [(rid, params)]}, max_num_seqs=1)
        alone[rid] = pixels[rid]
    outputs: list[RunnerOutput] = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call in a step raises
    try:
        together, _ = drive(dlo_cuda, {0: [(rid, p) for rid, p in REQUESTS.items()]},
                            max_num_seqs=4, outputs=outputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert max(o.forward_groups for o in outputs) == 3
    torch.cuda.synchronize()
    for rid in REQUESTS:
        torch.testing.assert_close(together[rid], alone[rid], atol=1e-2, rtol=0)
        assert together[rid].std() > 0.01
