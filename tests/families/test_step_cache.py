"""The step cache on every family (tiny models, CPU): off-equivalent settings are bit-identical
to no cache, resident and DLO; a cache skips what its policy says and DLO copies none of the
bytes of a step that reuses; a batched request equals its solo run with the cache; residuals
are per request and freed when it ends; teacache is refused where no coefficients exist."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig, StepCacheConfig
from ditserve.engine.config.step_cache import StepCacheSpec
from ditserve.engine.errors import ConfigError, InvalidRequestError
from ditserve.engine.request import NewRequest, SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.sched.work import ResolvedScheduling
from ditserve.engine.step.plan import RunnerOutput

STEPS = 8
TOLERANCE = 1e-4  # fp32 on CPU, decoded pixels in [0, 1] (as the batching tests)


def params(variant: str, cache: StepCacheSpec | None, **over: object) -> SamplingParams:
    fields: dict[str, object] = {"prompt": "a red fox in the snow", "num_inference_steps": STEPS,
                                 "seed": 7, "height": 32, "width": 32, "step_cache": cache}
    if variant == "wan":
        fields.update(num_frames=5, guidance_scale=1.0)
    fields.update(over)
    return SamplingParams(**fields)  # type: ignore[arg-type]


def make_runner(model: Path, *, dlo: bool, default: StepCacheConfig | None = None) -> ModelRunner:
    config = EngineConfig(model=str(model), device="cpu",
                          offload=OffloadConfig(enabled=dlo, checkpoint_mmap="off") if dlo
                          else OffloadConfig(),
                          step_cache=default or StepCacheConfig())
    return ModelRunner(RunnerConfig.of(config), model_dir=model)


def run(runner: ModelRunner, *requests: tuple[str, SamplingParams],
        arrivals: dict[int, list[tuple[str, SamplingParams]]] | None = None,
        ) -> tuple[dict[str, torch.Tensor], list[RunnerOutput]]:
    outputs: list[RunnerOutput] = []
    pixels, _ = drive(runner, arrivals or {0: list(requests)}, max_num_seqs=4, outputs=outputs)
    return pixels, outputs


def skipped(outputs: list[RunnerOutput]) -> tuple[int, int, int]:
    return (sum(o.step_cache_skipped_blocks for o in outputs),
            sum(o.step_cache_block_runs for o in outputs),
            sum(o.step_cache_skipped_bytes for o in outputs))


OFF_EQUIVALENT = [StepCacheSpec("first-block", threshold=0.0), StepCacheSpec("every", every=1),
                  StepCacheSpec("none")]


@pytest.mark.parametrize("dlo", [False, True], ids=["resident", "dlo"])
@pytest.mark.parametrize("variant", ["flux", "qwen-image", "wan", "z-image", "flux2", "flux2-klein"])
def test_threshold_zero_and_every_one_are_bit_identical(family_dir, variant: str,
                                                        dlo: bool) -> None:  # type: ignore[no-untyped-def]
    runner = make_runner(family_dir(variant), dlo=dlo)
    try:
        plain, _ = run(runner, ("plain", params(variant, None, num_inference_steps=4)))
        specs = OFF_EQUIVALENT + ([StepCacheSpec("teacache", threshold=0.0)]
                                  if variant == "flux" else [])
        for i, spec in enumerate(specs):
            got, outputs = run(runner, (f"r{i}", params(variant, spec, num_inference_steps=4)))
            assert torch.equal(got[f"r{i}"], plain["plain"]), spec
            assert skipped(outputs)[0] == 0
    finally:
        runner.close()
    # The server default at threshold 0 too.
    runner = make_runner(family_dir(variant), dlo=dlo,
                         default=StepCacheConfig(policy="first-block", threshold=0.0))
    try:
        got, _ = run(runner, ("default", params(variant, None, num_inference_steps=4)))
        assert torch.equal(got["default"], plain["plain"])
    finally:
        runner.close()


@pytest.mark.parametrize("variant", ["flux", "qwen-image", "wan", "z-image", "flux2"])
def test_every_skips_its_schedule_and_dlo_skips_the_bytes(family_dir, variant: str) -> None:  # type: ignore[no-untyped-def]
    outs = {}
    for dlo in (False, True):
        runner = make_runner(family_dir(variant), dlo=dlo)
        try:
            plain, _ = run(runner, ("plain", params(variant, None)))
            got, outputs = run(runner, ("every", params(variant, StepCacheSpec("every", every=2))))
            report = runner.offload_report()
        finally:
            runner.close()
        blocks, runs, nbytes = skipped(outputs)
        per_step = runs // STEPS
        # 8 steps: steps 0, 1 (warm-up) and 6, 7 (cool-down) compute; of 2..5, every second
        # one (3 and 5) reuses - all blocks, the first one included.
        assert blocks == 2 * per_step and runs == STEPS * per_step
        diff = (got["every"] - plain["plain"]).abs()
        assert 0 < diff.max().item() < 0.5  # a real skip, not a different image
        if dlo and report is not None and report["streamed_blocks"] > 2:
            # More blocks than slots: a reused step leaves blocks 2.. uncopied.
            assert nbytes > 0
        if not dlo:
            assert nbytes == 0
        outs[dlo] = got["every"]
    assert torch.allclose(outs[True], outs[False], atol=TOLERANCE, rtol=0)


def test_first_block_and_teacache_reuse_on_flux(family_dir) -> None:  # type: ignore[no-untyped-def]
    runner = make_runner(family_dir("flux"), dlo=True)
    try:
        plain, _ = run(runner, ("plain", params("flux", None)))
        for spec in (StepCacheSpec("first-block", threshold=0.5),
                     StepCacheSpec("teacache", threshold=1.0)):
            got, outputs = run(runner, (spec.policy, params("flux", spec)))
            blocks, runs, _ = skipped(outputs)
            assert 0 < blocks < runs, spec
            assert 0 < (got[spec.policy] - plain["plain"]).abs().max().item() < 0.5
    finally:
        runner.close()


@pytest.mark.parametrize("variant", ["flux", "wan"])
def test_batched_with_mixed_policies_equals_each_alone(family_dir, variant: str) -> None:  # type: ignore[no-untyped-def]
    """Requests at different steps with different policies (and some without) share forwards
    under DLO; rows that reuse and rows that compute sit in the same step, and a second shape
    group without a cache runs block-major beside them; each equals its solo run."""
    runner = make_runner(family_dir(variant), dlo=True)
    cfg = {"guidance_scale": 4.0, "negative_prompt": "blurry"} if variant == "wan" else {
        "true_cfg_scale": 3.0, "negative_prompt": "blurry"}
    arrivals = {
        0: [("every", params(variant, StepCacheSpec("every", every=3)))],
        1: [("fb", params(variant, StepCacheSpec("first-block", threshold=0.5), seed=9, **cfg)),
            ("plain", params(variant, None, seed=5, num_inference_steps=5))],
        2: [("every2", params(variant, StepCacheSpec("every", every=2), seed=3, num_images=2)),
            # Another token grid: its own shape group, block-major beside the cached ones,
            # without a cache - every block it needs must still be copied.
            ("wide", params(variant, None, seed=2, width=48))],
    }
    try:
        batched, outputs = run(runner, arrivals=arrivals)
        assert max(o.forward_requests for o in outputs) >= 3, "the scenario must batch"
        for requests in arrivals.values():
            for rid, p in requests:
                alone, _ = run(runner, (f"alone-{rid}", p))
                diff = (batched[rid] - alone[f"alone-{rid}"]).abs().max().item()
                assert diff <= TOLERANCE, f"{variant} {rid}: max abs diff {diff}"
    finally:
        runner.close()


def test_residuals_are_per_request_and_freed_when_it_ends(family_dir) -> None:  # type: ignore[no-untyped-def]
    runner = make_runner(family_dir("flux"), dlo=False)
    try:
        p = params("flux", StepCacheSpec("every", every=2), num_inference_steps=4)
        plan_steps = []
        from ditserve.engine.config import SchedulerConfig
        from ditserve.engine.sched.scheduler import StepScheduler

        scheduler = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=2)))
        for rid in ("a", "b"):
            scheduler.add(rid, p, runner.work_rule.of(p))
        new = [NewRequest("a", p, 1), NewRequest("b", p, 2)]
        while scheduler.has_work():
            plan = scheduler.schedule()
            out = runner.execute(plan, new)
            new = []
            scheduler.update(plan, out)
            plan_steps.append(runner.step_cache.resident_bytes())
        assert max(plan_steps) > 0  # two requests' residuals while they run
        assert runner.step_cache.resident_bytes() == 0  # and none once they ended
    finally:
        runner.close()


def test_teacache_is_refused_without_published_coefficients(family_dir) -> None:  # type: ignore[no-untyped-def]
    for variant, words in (("qwen-image", "no published rescaling coefficients"),
                           ("wan", "Wan2.1 T2V 1.3B")):
        runner = make_runner(family_dir(variant), dlo=False)
        try:
            with pytest.raises(InvalidRequestError, match=words):
                runner.step_cache.check(StepCacheSpec("teacache"))
            with pytest.raises(InvalidRequestError, match=words):  # not even at threshold 0
                runner.step_cache.check(StepCacheSpec("teacache", threshold=0.0))
            runner.step_cache.check(StepCacheSpec("first-block"))  # the others work
            assert runner.step_cache.policies == ("first-block", "every")
        finally:
            runner.close()
    with pytest.raises(ConfigError, match="--step-cache teacache: teacache has no published"):
        make_runner(family_dir("qwen-image"), dlo=False,
                    default=StepCacheConfig(policy="teacache"))
