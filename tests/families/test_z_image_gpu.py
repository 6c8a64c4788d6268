"""Z-Image on CUDA (run on the device machine): DLO equals resident bitwise (in
test_families_gpu.py); here its denoise and decode steps - CFG rows, captions of different
lengths, an inpainting blend - queue their work without a host sync, and the results equal
the same requests run one by one (to float tolerance)."""

from __future__ import annotations

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from ditserve.engine.request import ConditionImage, NewRequest, SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.sched.scheduler import StepScheduler
from ditserve.engine.sched.work import ResolvedScheduling

pytestmark = pytest.mark.gpu


def requests() -> list[tuple[str, SamplingParams]]:
    grey = ConditionImage(32, 32, bytes([128]) * 32 * 32 * 3)
    half = bytearray(32 * 32 * 3)
    for row in range(32):
        half[row * 96: row * 96 + 48] = b"\xff" * 48  # repaint the left half
    mask = ConditionImage(32, 32, bytes(half))
    return [
        ("turbo", SamplingParams(prompt="a red fox in the snow", guidance_scale=0.0, seed=1,
                                 num_inference_steps=4, height=32, width=32)),
        ("cfg", SamplingParams(prompt="castle", negative_prompt="fog and rain", seed=2,
                               guidance_scale=3.0, num_inference_steps=4, height=32, width=32)),
        ("inpaint", SamplingParams(prompt="a boat", guidance_scale=0.0, seed=3, strength=1.0,
                                   num_inference_steps=4, height=32, width=32, images=(grey,),
                                   mask=mask)),
    ]


def test_steps_do_not_sync_and_equal_alone(family_dir) -> None:  # type: ignore[no-untyped-def]
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = family_dir("z-image")
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cuda")),
                         model_dir=model)
    scheduler = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=3)))
    finished: dict[str, torch.Tensor] = {}

    def step(new: list[tuple[str, SamplingParams]]) -> None:
        for rid, params in new:
            scheduler.add(rid, params, runner.work_rule.of(params))
        plan = scheduler.schedule()
        output = runner.execute(plan, [NewRequest(rid, p, p.seed or 0) for rid, p in new])
        assert not output.failed, output.failed
        scheduler.update(plan, output)
        finished.update(output.finished)

    step(requests())  # admission (prompt encode, VAE encode of the source) runs here
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        for _ in range(3):  # the remaining denoise steps, the last with the decodes
            step([])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    while scheduler.has_work():
        step([])
    assert set(finished) == {rid for rid, _ in requests()}
    for rid, params in requests():
        alone, _ = drive(runner, {0: [(f"alone-{rid}", params)]}, max_num_seqs=1)
        # Batched vs alone: other kernels for other batch shapes (tests/families/
        # test_batching.py's bound, with room for CUDA's float32 kernels).
        diff = (finished[rid] - alone[f"alone-{rid}"]).abs().max().item()
        assert diff <= 1e-3, f"{rid}: {diff}"
