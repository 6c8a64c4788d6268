"""On CUDA, engine steps queue their work without a host sync (run on the device).

A host sync between steps leaves the GPU idle while the host prepares the next step; with
layerwise offload it also stalls the copy engine. No step may sync: not a denoise step, not an
admission, not a decode (pixels come back through pinned memory, a step later). The runner may
only wait for the *previous* step's fence, which leaves the current step queued on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from ditserve.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from ditserve.engine.request import NewRequest, SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.sched.scheduler import StepScheduler
from ditserve.engine.sched.work import ResolvedScheduling

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_runner(tiny_model_dir):  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return ModelRunner(RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cuda")),
                       model_dir=tiny_model_dir)


def test_no_step_syncs_and_pixels_come_back_a_step_late(cuda_runner) -> None:  # type: ignore[no-untyped-def]
    scheduler = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=2)))
    finished: dict[str, torch.Tensor] = {}

    def step(new: list[tuple[str, SamplingParams]]) -> list[str]:
        for rid, params in new:
            scheduler.add(rid, params)
        plan = scheduler.schedule()
        output = cuda_runner.execute(plan, [NewRequest(rid, p, p.seed or 0) for rid, p in new])
        assert not output.failed, output.failed
        scheduler.update(plan, output)
        finished.update(output.finished)
        return list(plan.decode)

    step([("warm", SamplingParams(prompt="w", num_inference_steps=2, seed=0))])
    step([])
    step([])  # flushes the warm-up decode
    assert "warm" in finished
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        step([("a", SamplingParams(prompt="a", num_inference_steps=3, seed=1))])  # admission
        step([("b", SamplingParams(prompt="b", num_inference_steps=3, seed=2))])  # admission
        assert step([]) == ["a"]  # a's decode is queued, not waited for
        assert "a" not in finished
        assert step([]) == ["b"]
        assert "a" in finished  # handed back with the next step
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while scheduler.has_work():
        step([])
    assert set(finished) == {"warm", "a", "b"}


def test_pipelined_pixels_equal_a_synchronous_decode(cuda_runner) -> None:  # type: ignore[no-untyped-def]
    # Pixels read before their copy finished would be stale pinned memory, not the image.
    from engine.driver import drive  # type: ignore[import-not-found]

    params = {rid: SamplingParams(prompt=rid, num_inference_steps=3, seed=seed)
              for seed, rid in enumerate(["p", "q", "r"])}
    together, _ = drive(cuda_runner, {0: [("p", params["p"])], 1: [("q", params["q"])],
                                      2: [("r", params["r"])]}, max_num_seqs=3)
    for rid, p in params.items():
        alone, _ = drive(cuda_runner, {0: [(rid, p)]}, max_num_seqs=1)
        torch.cuda.synchronize()
        assert together[rid].shape == alone[rid].shape
        torch.testing.assert_close(together[rid], alone[rid], atol=1e-2, rtol=0)
        assert together[rid].std() > 0.01  # an image, not zeroed memory
