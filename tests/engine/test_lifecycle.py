"""The engine lifecycle: one phase enum moved forward only, and the warm-up that precedes READY."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from ditserve.engine.config import EngineConfig, SchedulerConfig
from ditserve.engine.errors import DitServeError, EngineStoppedError
from ditserve.engine.executor import RankWork
from ditserve.engine.loop.engine import DiffusionEngine, EnginePhase, WarmUp
from ditserve.engine.loop.lifecycle import Lifecycle
from ditserve.engine.loop.startup import warm_up
from ditserve.engine.request import ModelLimits, SamplingParams
from ditserve.engine.sched.work import WorkRule
from ditserve.engine.step.plan import RunnerOutput


def test_phases_only_move_forward_and_final_phases_stay() -> None:
    life = Lifecycle()
    assert life.phase is EnginePhase.LOADING
    assert life.move(EnginePhase.READY)  # COMPILING is skipped without --compile
    assert not life.move(EnginePhase.COMPILING)
    assert life.move(EnginePhase.DRAINING) and not life.move(EnginePhase.READY)
    assert life.move(EnginePhase.FAILED, "the engine loop died: boom")
    assert not life.move(EnginePhase.STOPPED)  # shutting a failed engine down keeps the why
    assert (life.phase, life.error) == (EnginePhase.FAILED, "the engine loop died: boom")


def test_a_drain_while_loading_keeps_the_engine_from_turning_ready() -> None:
    life = Lifecycle()
    assert life.move(EnginePhase.DRAINING)
    assert not life.move(EnginePhase.READY)
    assert life.move(EnginePhase.STOPPED) and life.phase.is_final


def test_failed_goes_with_an_error_and_only_failed_does() -> None:
    with pytest.raises(ValueError):
        Lifecycle().move(EnginePhase.FAILED)
    with pytest.raises(ValueError):
        Lifecycle().move(EnginePhase.READY, "not an error")


def test_engine_phases_from_loading_to_stopped(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    engine = DiffusionEngine(EngineConfig(model=str(tiny_model_dir), device="cpu",
                                          scheduler=SchedulerConfig(max_num_seqs=1)))
    assert engine.phase is EnginePhase.LOADING and not engine.ready
    engine.start()
    try:
        assert engine.phase is EnginePhase.READY and engine.failure is None
        admitted = engine.add_request(SamplingParams(prompt="x", num_inference_steps=3, seed=1))
        engine.drain()
        assert engine.phase is EnginePhase.DRAINING
        with pytest.raises(EngineStoppedError, match="not accepting"):
            engine.add_request(SamplingParams(prompt="late", seed=2))
        assert admitted.result(timeout=60).images  # admitted work runs to the end
    finally:
        engine.shutdown()
    assert engine.phase is EnginePhase.STOPPED


def test_a_failed_start_leaves_the_engine_failed_with_the_reason(tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = DiffusionEngine(EngineConfig(model=str(tmp_path / "missing"), device="cpu"))
    with pytest.raises(DitServeError):
        engine.start()
    assert engine.phase is EnginePhase.FAILED
    assert engine.failure is not None and "missing" in engine.failure
    with pytest.raises(EngineStoppedError, match="missing"):
        engine.add_request(SamplingParams(prompt="x"))
    engine.shutdown()  # nothing to stop; the reason stays
    assert engine.phase is EnginePhase.FAILED


class ScriptedExecutor:
    """Two ranks whose runners finish every admitted request at once (or forget one)."""

    num_ranks = 2
    step_groups = ((0,), (1,))

    def __init__(self, *, drop: str | None = None) -> None:
        # What the warm-up reads of rank 0's runner: its pixel multiple, the input images its
        # model needs, its limits (the shortest clip) and its work rule.
        self.runner = type("Runner", (), {"pixel_multiple": 16, "condition_images": (0, 0),
                                          "limits": ModelLimits(),
                                          "work_rule": WorkRule(pixels_per_token=16)})()
        self.drop = drop
        self.steps: list[dict[int, RankWork]] = []

    def step(self, work: Mapping[int, RankWork]) -> dict[int, RunnerOutput]:
        self.steps.append(dict(work))
        return {rank: RunnerOutput(finished={n.request_id: "pixels" for n in w.new
                                             if n.request_id != self.drop})
                for rank, w in work.items()}


def sizes_and_batches(executor: ScriptedExecutor) -> list[tuple[int, int, int] | str]:
    """Per step: (height, width, requests per rank), or "idle" for an idle flush."""
    out: list[tuple[int, int, int] | str] = []
    for work in executor.steps:
        assert set(work) == {0, 1}, "every warm-up step runs on every rank"
        first = work[0]
        if not first.new:
            assert all(w.plan.step_id is None for w in work.values())
            out.append("idle")
            continue
        params = first.new[0].params
        out.append((params.height, params.width, len(first.new)))
    return out


def test_warm_up_compiles_at_the_given_size_for_batch_one_and_two() -> None:
    executor = ScriptedExecutor()
    compiling = []
    warm_up(executor, WarmUp(compile_size=(96, 128)),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(max_num_seqs=4), compile="aot_eager",
            on_compiling=lambda: compiling.append(True))
    assert compiling == [True]
    assert sizes_and_batches(executor) == [(32, 32, 1), "idle", (96, 128, 1), "idle",
                                           (96, 128, 2), "idle"]


def test_warm_up_without_compile_is_one_small_step() -> None:
    executor = ScriptedExecutor()
    compiling = []
    warm_up(executor, WarmUp(compile_size=(96, 128)),  # type: ignore[arg-type]
            scheduler=SchedulerConfig(), compile=None,
            on_compiling=lambda: compiling.append(True))
    assert compiling == [] and sizes_and_batches(executor) == [(32, 32, 1), "idle"]


def test_warm_up_fails_when_a_rank_returns_no_image() -> None:
    executor = ScriptedExecutor(drop="warmup-1-0")
    with pytest.raises(DitServeError, match="rank 1 returned no image for warmup-1-0"):
        warm_up(executor, WarmUp(), scheduler=SchedulerConfig(),  # type: ignore[arg-type]
                compile=None, on_compiling=lambda: None)
