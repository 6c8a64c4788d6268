"""StepScheduler: admission, capacity, batching rules, abort, errors, finish order (no torch)."""

from __future__ import annotations

import pytest

from ditserve.engine.config import SchedulerConfig
from ditserve.engine.request import RequestStatus, SamplingParams
from ditserve.engine.scheduler import RunnerOutput, StepPlan, StepScheduler


def params(steps: int = 4, size: int = 64, **kw: object) -> SamplingParams:
    return SamplingParams(prompt="p", num_inference_steps=steps, height=size, width=size, **kw)  # type: ignore[arg-type]


def run_step(s: StepScheduler, fail: dict[str, str] | None = None) -> StepPlan:
    """Execute a plan the way a perfect runner would, optionally failing some requests."""
    plan = s.schedule()
    fail = fail or {}
    out = RunnerOutput(failed=dict(fail))
    out.stepped = [r for r in plan.denoise if r not in fail]
    out.decoded = [r for r in plan.decode if r not in fail]
    out.finished = {r: f"pixels of {r}" for r in out.decoded}  # a CPU runner: at once
    s.update(plan, out)
    return plan


def test_fifo_admission_order_and_capacity() -> None:
    s = StepScheduler(SchedulerConfig(max_num_seqs=2, max_bypass=0))
    for rid in "abc":
        s.add(rid, params())
    plan = s.schedule()
    assert plan.encode == ("a", "b")
    assert plan.denoise == ("a", "b")
    assert s.num_waiting == 1 and s.queue_position("c") == 0


def test_mixed_step_counts_share_a_batch_and_finish_in_step_order() -> None:
    s = StepScheduler(SchedulerConfig(max_num_seqs=4))
    s.add("long", params(steps=5))
    s.add("short", params(steps=2))
    finished: list[str] = []
    for _ in range(5):
        plan = run_step(s)
        finished.extend(plan.decode)
    assert finished == ["short", "long"]
    assert not s.has_work()


def test_late_arrival_joins_running_batch_at_a_different_step() -> None:
    s = StepScheduler(SchedulerConfig(max_num_seqs=4))
    s.add("a", params(steps=4))
    run_step(s)
    run_step(s)
    s.add("b", params(steps=3))
    plan = run_step(s)
    assert plan.encode == ("b",) and set(plan.denoise) == {"a", "b"}
    a, b = s.get("a"), s.get("b")
    assert a is not None and b is not None
    assert (a.steps_done, b.steps_done) == (3, 1)


def test_fifo_head_of_line_blocking_by_incompatible_head() -> None:
    s = StepScheduler(SchedulerConfig(max_num_seqs=4, max_bypass=0))
    s.add("a", params(size=64, steps=3))
    run_step(s)
    s.add("big", params(size=128))
    s.add("small", params(size=64))
    plan = run_step(s)
    # "small" is compatible with the running batch but stuck behind "big".
    assert plan.encode == ()
    assert s.queue_position("big") == 0 and s.queue_position("small") == 1


def test_bypass_admits_compatible_requests_behind_incompatible_head() -> None:
    s = StepScheduler(SchedulerConfig(max_num_seqs=4, max_bypass=8))
    s.add("a", params(size=64, steps=3))
    run_step(s)
    s.add("big", params(size=128))
    s.add("small", params(size=64))
    plan = run_step(s)
    assert plan.encode == ("small",)
    big = s.get("big")
    assert big is not None and big.times_bypassed == 1


def test_bypass_bound_guarantees_the_head_is_admitted() -> None:
    bound = 3
    s = StepScheduler(SchedulerConfig(max_num_seqs=2, max_bypass=bound))
    s.add("r0", params(size=64, steps=2))
    run_step(s)
    s.add("big", params(size=128, steps=1))
    # An endless stream of compatible small requests keeps arriving.
    admitted_before_big: list[str] = []
    counter = 1
    for _ in range(40):
        s.add(f"r{counter}", params(size=64, steps=2))
        counter += 1
        plan = run_step(s)
        if "big" in plan.encode:
            break
        admitted_before_big.extend(plan.encode)
    else:
        pytest.fail("the incompatible head was starved")
    assert len(admitted_before_big) == bound


def test_abort_waiting_and_running() -> None:
    s = StepScheduler(SchedulerConfig(max_num_seqs=1))
    s.add("a", params(steps=3))
    s.add("b", params(steps=3))
    run_step(s)
    assert s.abort("b") is True  # waiting
    assert s.abort("a") is True  # running: freed at the next step boundary
    plan = s.schedule()
    assert plan.freed == ("a",) and plan.denoise == ()
    assert s.abort("missing") is False
    assert not s.has_work()


def test_failed_request_fails_alone() -> None:
    s = StepScheduler(SchedulerConfig(max_num_seqs=4))
    s.add("ok", params(steps=2))
    s.add("bad", params(steps=2))
    plan = s.schedule()
    changes = s.update(plan, RunnerOutput(stepped=["ok"], failed={"bad": "encode failed"}))
    statuses = {c.request_id: c.status for c in changes}
    assert statuses == {"ok": RequestStatus.DENOISING, "bad": RequestStatus.FINISHED_ERROR}
    plan = run_step(s)
    assert plan.decode == ("ok",) and not s.has_work()


def test_update_reports_finished_last() -> None:
    s = StepScheduler(SchedulerConfig(max_num_seqs=4))
    s.add("one", params(steps=1))
    s.add("two", params(steps=2))
    plan = s.schedule()
    changes = s.update(plan, RunnerOutput(stepped=["one", "two"], decoded=["one"],
                                          finished={"one": "pixels"}))
    assert [c.status.is_finished for c in changes] == [False, False, True]


def test_output_handed_back_a_step_late_frees_the_slot_at_decode() -> None:
    # A GPU runner returns a step's decoded pixels with the next step's output.
    s = StepScheduler(SchedulerConfig(max_num_seqs=1))
    s.add("a", params(steps=1))
    s.add("b", params(steps=2))
    plan = s.schedule()
    assert plan.decode == ("a",)
    changes = s.update(plan, RunnerOutput(stepped=["a"], decoded=["a"]))
    assert [c.status for c in changes] == [RequestStatus.DENOISING]
    a = s.get("a")
    assert a is not None and a.status == RequestStatus.DECODING and s.has_work()
    plan = s.schedule()
    assert plan.encode == ("b",) and plan.denoise == ("b",)  # a's slot went to b at once
    changes = s.update(plan, RunnerOutput(stepped=["b"], finished={"a": "pixels"}))
    assert [(c.request_id, c.status) for c in changes] == [
        ("b", RequestStatus.DENOISING), ("a", RequestStatus.FINISHED_OK)]
    assert s.get("a") is None


def test_abort_while_decoding_frees_runner_state_and_ignores_late_output() -> None:
    s = StepScheduler(SchedulerConfig(max_num_seqs=2))
    s.add("a", params(steps=1))
    plan = s.schedule()
    s.update(plan, RunnerOutput(stepped=["a"], decoded=["a"]))
    assert s.abort("a")
    plan = s.schedule()
    assert plan.freed == ("a",) and not plan.denoise
    assert s.update(plan, RunnerOutput(finished={"a": "pixels"})) == []
    assert not s.has_work()


def test_a_request_id_is_scheduled_once() -> None:
    s = StepScheduler(SchedulerConfig(max_num_seqs=1))
    s.add("a", params())
    with pytest.raises(ValueError):
        s.add("a", params())


def test_batch_key_ignores_steps_seed_guidance_and_cfg() -> None:
    a = params(steps=4, seed=1, guidance_scale=3.5)
    b = params(steps=9, seed=2, guidance_scale=1.0, negative_prompt="n", true_cfg_scale=4.0)
    assert a.batch_key() == b.batch_key()
    assert a.batch_key() != params(size=128).batch_key()
    assert (a.rows, b.rows) == (1, 2)
