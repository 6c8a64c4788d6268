"""StepScheduler: admission, capacity, batching rules, abort, errors, finish order (no torch)."""

from __future__ import annotations

import pytest

from ditserve.engine.config import SchedulerConfig
from ditserve.engine.request import RequestStatus, SamplingParams
from ditserve.engine.sched.scheduler import StepScheduler
from ditserve.engine.sched.work import ResolvedScheduling
from ditserve.engine.step.plan import RunnerOutput, StepPlan


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
    s = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=2, max_bypass=0)))
    for rid in "abc":
        s.add(rid, params())
    plan = s.schedule()
    assert plan.encode == ("a", "b")
    assert plan.denoise == ("a", "b")
    assert s.num_waiting == 1 and s.queue_position("c") == 0


def test_mixed_step_counts_share_a_batch_and_finish_in_step_order() -> None:
    s = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=4)))
    s.add("long", params(steps=5))
    s.add("short", params(steps=2))
    finished: list[str] = []
    for _ in range(5):
        plan = run_step(s)
        finished.extend(plan.decode)
    assert finished == ["short", "long"]
    assert not s.has_work()


def test_late_arrival_joins_running_batch_at_a_different_step() -> None:
    s = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=4)))
    s.add("a", params(steps=4))
    run_step(s)
    run_step(s)
    s.add("b", params(steps=3))
    plan = run_step(s)
    assert plan.encode == ("b",) and set(plan.denoise) == {"a", "b"}
    a, b = s.get("a"), s.get("b")
    assert a is not None and b is not None
    assert (a.steps_done, b.steps_done) == (3, 1)


def test_requests_of_different_shapes_share_a_step() -> None:
    s = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=4)))
    s.add("a", params(size=64, steps=3))
    run_step(s)
    s.add("wide", SamplingParams(prompt="p", height=64, width=128))
    s.add("big", params(size=128))
    plan = run_step(s)
    assert plan.encode == ("wide", "big") and plan.denoise == ("a", "wide", "big")
    assert len(s.running_keys()) == 3


def budgeted(budget: int, *, max_num_seqs: int = 8, max_bypass: int = 8) -> StepScheduler:
    return StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=max_num_seqs, max_batch_tokens=budget,
                                         max_bypass=max_bypass)))


# With the default work rule (16-pixel tokens): 64x64 is 16 tokens, 128x128 is 64.
def test_fifo_head_that_does_not_fit_blocks_everyone_behind() -> None:
    s = budgeted(80, max_bypass=0)
    s.add("a", params(size=64, steps=3))  # 16 of 80
    run_step(s)
    s.add("big", params(size=128))  # 64: exactly the room left
    s.add("big2", params(size=128))  # no room left after big
    s.add("small", params(size=64))
    plan = run_step(s)
    assert plan.encode == ("big",)
    assert s.queue_position("big2") == 0 and s.queue_position("small") == 1


def test_fifo_blocks_a_request_that_fits_behind_one_that_does_not() -> None:
    s = budgeted(96, max_bypass=0)
    s.add("a", params(size=64, steps=3))
    run_step(s)
    s.add("big", params(size=128, negative_prompt="n", true_cfg_scale=2.0))  # 2 x 64 rows
    s.add("small", params(size=64))  # 16: fits the 80 left
    plan = run_step(s)
    assert plan.encode == ()
    assert s.queue_position("big") == 0 and s.queue_position("small") == 1


def test_bypass_admits_requests_that_fit_behind_one_that_does_not() -> None:
    s = budgeted(96, max_bypass=8)
    s.add("a", params(size=64, steps=3))
    run_step(s)
    s.add("big", params(size=128, negative_prompt="n", true_cfg_scale=2.0))
    s.add("small", params(size=64))
    plan = run_step(s)
    assert plan.encode == ("small",)
    big = s.get("big")
    assert big is not None and big.times_bypassed == 1


def test_bypass_bound_holds_within_one_admission_pass() -> None:
    # A burst of small requests behind a large one that does not fit: only max_bypass of
    # them may pass it, even though all of them fit and arrive before one schedule().
    bound = 3
    s = budgeted(200, max_num_seqs=32, max_bypass=bound)
    s.add("running", params(size=128, steps=10))  # 64 of 200
    run_step(s)
    s.add("big", params(size=128, num_images=3))  # 192: waits for the running request
    for i in range(10):
        s.add(f"small{i}", params(size=64))
    plan = run_step(s)
    assert plan.encode == ("small0", "small1", "small2")
    big = s.get("big")
    assert big is not None and big.times_bypassed == bound
    plan = run_step(s)
    assert plan.encode == ()  # nobody passes it any more: the step drains for it


def test_bypass_bound_counts_against_every_request_passed() -> None:
    s = budgeted(100, max_bypass=1)
    s.add("running", params(size=128, steps=5))  # 64 of 100
    run_step(s)
    s.add("big", params(size=128))  # 64 > 36 left
    s.add("big2", params(size=128))
    s.add("small0", params(size=64))
    s.add("small1", params(size=64))
    plan = run_step(s)
    assert plan.encode == ("small0",)  # passes both; one more pass would exceed the bound
    assert [s.get(r).times_bypassed for r in ("big", "big2")] == [1, 1]  # type: ignore[union-attr]


def test_bypass_bound_guarantees_the_head_is_admitted() -> None:
    bound = 3
    s = budgeted(96, max_num_seqs=8, max_bypass=bound)
    s.add("r0", params(size=128, steps=8))  # 64 of 96, for 8 steps
    run_step(s)
    s.add("big", params(size=128, steps=1))  # 64 > 32 left
    # An endless stream of small requests keeps arriving, each of which fits.
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
        pytest.fail("the large request was starved")
    assert len(admitted_before_big) == bound


def test_work_budget_fills_with_a_mix_of_small_and_large_requests() -> None:
    # 16384 tokens per step (the default at max_num_seqs 4: four 1024x1024 images of 4096
    # tokens); a 512x512 image is 1024 tokens, so small requests fill around large ones.
    s = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=16, max_batch_tokens=16384)))
    # Unset, the budget scales with max_num_seqs: that many of the family's usual requests.
    assert StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=16))).config.max_batch_tokens == 16 * 4096
    sizes = {"l0": 1024, "s0": 512, "l1": 1024, "s1": 512, "l2": 1024, "s2": 512,
             "s3": 512, "l3": 1024, "s4": 512}
    for rid, size in sizes.items():
        s.add(rid, params(size=size))
    plan = s.schedule()
    # 3 x 4096 + 4 x 1024 = 16384: l3 (4096) does not fit the 0 left, s4 neither.
    assert plan.encode == ("l0", "s0", "l1", "s1", "l2", "s2", "s3")
    assert s.queue_position("l3") == 0


def test_max_num_seqs_caps_requests_whatever_their_work() -> None:
    s = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=2)))
    for rid in "abc":
        s.add(rid, params(size=64))  # 16 tokens each, far below the budget
    assert s.schedule().encode == ("a", "b")


def test_a_request_larger_than_the_budget_runs_alone() -> None:
    s = budgeted(32)
    s.add("huge", params(size=256))  # 256 tokens
    s.add("small", params(size=64))
    plan = run_step(s)
    assert plan.encode == ("huge",)
    while "small" not in plan.encode:
        assert plan.denoise == ("huge",), "nothing joins a request larger than the budget"
        plan = run_step(s)
    assert plan.denoise == ("small",)


def test_explicit_work_overrides_the_default_rule() -> None:
    from ditserve.engine.step.plan import RequestWork

    s = budgeted(100)
    s.add("a", params(size=64), RequestWork(rows=2, tokens_per_row=40))
    s.add("b", params(size=64), RequestWork(rows=1, tokens_per_row=40))
    assert s.schedule().encode == ("a",)
    assert s.committed_tokens() == 120


def test_abort_waiting_and_running() -> None:
    s = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1)))
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
    s = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=4)))
    s.add("ok", params(steps=2))
    s.add("bad", params(steps=2))
    plan = s.schedule()
    changes = s.update(plan, RunnerOutput(stepped=["ok"], failed={"bad": "encode failed"}))
    statuses = {c.request_id: c.status for c in changes}
    assert statuses == {"ok": RequestStatus.DENOISING, "bad": RequestStatus.FINISHED_ERROR}
    plan = run_step(s)
    assert plan.decode == ("ok",) and not s.has_work()


def test_update_reports_finished_last() -> None:
    s = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=4)))
    s.add("one", params(steps=1))
    s.add("two", params(steps=2))
    plan = s.schedule()
    changes = s.update(plan, RunnerOutput(stepped=["one", "two"], decoded=["one"],
                                          finished={"one": "pixels"}))
    assert [c.status.is_finished for c in changes] == [False, False, True]


def test_output_handed_back_a_step_late_frees_the_slot_at_decode() -> None:
    # A GPU runner returns a step's decoded pixels with the next step's output.
    s = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1)))
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
    s = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=2)))
    s.add("a", params(steps=1))
    plan = s.schedule()
    s.update(plan, RunnerOutput(stepped=["a"], decoded=["a"]))
    assert s.abort("a")
    plan = s.schedule()
    assert plan.freed == ("a",) and not plan.denoise
    assert s.update(plan, RunnerOutput(finished={"a": "pixels"})) == []
    assert not s.has_work()


def test_a_request_id_is_scheduled_once() -> None:
    s = StepScheduler(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1)))
    s.add("a", params())
    with pytest.raises(ValueError):
        s.add("a", params())


def test_batch_key_ignores_steps_seed_guidance_and_cfg() -> None:
    a = params(steps=4, seed=1, guidance_scale=3.5)
    b = params(steps=9, seed=2, guidance_scale=1.0, negative_prompt="n", true_cfg_scale=4.0)
    assert a.batch_key() == b.batch_key()
    assert a.batch_key() != params(size=128).batch_key()
    assert (a.rows, b.rows) == (1, 2)
