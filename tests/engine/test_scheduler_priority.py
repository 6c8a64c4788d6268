"""StepScheduler under the priority policy: strict order, aging bound, pause and resume at step
boundaries, the pause limit, deadlines (refusal, stop at a step boundary), fcfs unchanged.

Pure Python with an injected clock: one engine step is one second of fake time."""

from __future__ import annotations

import pytest

from ditserve.engine.config import SchedulerConfig
from ditserve.engine.errors import DeadlineError
from ditserve.engine.request import RequestStatus, SamplingParams
from ditserve.engine.sched.rank_queues import RankQueues
from ditserve.engine.sched.scheduler import StepScheduler
from ditserve.engine.sched.work import ResolvedScheduling
from ditserve.engine.step.plan import RunnerOutput, StatusChange, StepPlan


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def params(steps: int = 4, size: int = 64, **kw: object) -> SamplingParams:
    return SamplingParams(prompt="p", num_inference_steps=steps, height=size, width=size, **kw)  # type: ignore[arg-type]


def scheduler(clock: FakeClock, *, policy: str = "priority", **kw: object) -> StepScheduler:
    config = SchedulerConfig(scheduling_policy=policy, **kw)  # type: ignore[arg-type]
    return StepScheduler(ResolvedScheduling.for_family(config), clock=clock)


def run_step(s: StepScheduler, clock: FakeClock,
             changes: list[StatusChange] | None = None) -> StepPlan:
    """Plan and execute one step as a perfect CPU runner would; it takes one second."""
    plan = s.schedule()
    clock.now += 1.0
    out = RunnerOutput(stepped=list(plan.denoise), decoded=list(plan.decode))
    out.finished = {r: f"pixels of {r}" for r in out.decoded}
    reported = s.update(plan, out)
    if changes is not None:
        changes.extend(reported)
    return plan


def finish_order(s: StepScheduler, clock: FakeClock, steps: int = 50) -> list[str]:
    order: list[str] = []
    for _ in range(steps):
        order.extend(run_step(s, clock).decode)
        if not s.has_work():
            break
    return order


def test_priority_admits_lower_value_first_then_deadline_then_arrival() -> None:
    clock = FakeClock()
    s = scheduler(clock, max_num_seqs=1)
    s.add("batch-a", params(priority=1))
    s.add("batch-b", params(priority=1))
    s.add("late-deadline", params(priority=0, deadline_s=500.0))
    s.add("early-deadline", params(priority=0, deadline_s=100.0))
    s.add("no-deadline", params(priority=0))
    assert s.waiting_ids() == ["early-deadline", "late-deadline", "no-deadline", "batch-a",
                               "batch-b"]
    assert finish_order(s, clock) == ["early-deadline", "late-deadline", "no-deadline",
                                      "batch-a", "batch-b"]


def test_fcfs_ignores_priority_and_never_pauses() -> None:
    clock = FakeClock()
    s = scheduler(clock, policy="fcfs", max_num_seqs=1)
    s.add("low", params(priority=5))
    run_step(s, clock)
    s.add("high", params(priority=-5))
    changes: list[StatusChange] = []
    plans = [run_step(s, clock, changes) for _ in range(3)]
    assert all(p.denoise == ("low",) for p in plans)
    assert RequestStatus.PAUSED not in {c.status for c in changes}
    assert finish_order(s, clock) == ["high"]


def test_aging_never_lets_a_request_arriving_aging_bound_later_go_first() -> None:
    # Priority 2 under an overload of priority 0 (one arrives per second, one finishes per two
    # seconds): it is ordered as a priority-0 request arriving (2 - 0) x aging_s = 20 s later,
    # so every request that overtakes it arrived less than 20 s after it, and it is admitted.
    clock = FakeClock()
    s = scheduler(clock, max_num_seqs=1, aging_s=10.0, max_preemptions=0)
    s.add("low", params(priority=2, steps=2))
    arrivals = {"low": clock.now}
    admitted: list[str] = []
    for i in range(80):
        arrivals[f"high-{i}"] = clock.now
        s.add(f"high-{i}", params(priority=0, steps=2))
        admitted.extend(run_step(s, clock).encode)
        if "low" in admitted:
            break
    assert "low" in admitted, "the low-priority request starved"
    overtook = admitted[:admitted.index("low")]
    assert overtook and max(arrivals[r] for r in overtook) - arrivals["low"] < 20.0
    assert f"high-{20}" not in overtook


def test_a_higher_priority_request_pauses_the_lowest_and_it_resumes_where_it_stopped() -> None:
    clock = FakeClock()
    s = scheduler(clock, max_num_seqs=2)
    s.add("batch-old", params(priority=1, steps=6))
    s.add("batch-new", params(priority=2, steps=6))
    run_step(s, clock)
    run_step(s, clock)  # both have done 2 steps
    s.add("interactive", params(priority=0, steps=2))
    changes: list[StatusChange] = []
    plan = run_step(s, clock, changes)
    # The worst priority is paused at this boundary; the newcomer takes its place at once.
    assert plan.encode == ("interactive",)
    assert set(plan.denoise) == {"batch-old", "interactive"}
    assert "batch-new" not in plan.decode and "batch-new" not in plan.freed
    assert [(c.request_id, c.status) for c in changes if c.status == RequestStatus.PAUSED] \
        == [("batch-new", RequestStatus.PAUSED)]
    paused = s.get("batch-new")
    assert paused is not None and paused.steps_done == 2 and s.num_paused == 1
    resumed: list[StatusChange] = []
    plans = [run_step(s, clock, resumed) for _ in range(2)]
    assert plans[0].decode == ("interactive",)
    # Resumed without a second encode, from the step it stopped at.
    assert "batch-new" in plans[1].denoise and "batch-new" not in plans[1].encode
    first = next(c for c in resumed if c.request_id == "batch-new")
    assert first.status == RequestStatus.DENOISING and first.steps_done == 3
    assert first.resumed_after_s == pytest.approx(2.0)
    assert finish_order(s, clock) == ["batch-old", "batch-new"]


def test_equal_priority_is_never_paused_and_pausing_must_make_room() -> None:
    clock = FakeClock()
    s = scheduler(clock, max_num_seqs=4, max_batch_tokens=64)
    s.add("big", params(priority=0, size=128, steps=5))  # 64 tokens: the whole budget
    run_step(s, clock)
    s.add("same", params(priority=0))
    plan = run_step(s, clock)
    assert plan.denoise == ("big",) and s.num_paused == 0
    s2 = scheduler(FakeClock(), max_num_seqs=4, max_batch_tokens=80)
    s2.add("high-big", params(priority=0, size=128, steps=5))  # 64
    s2.add("low-small", params(priority=5, steps=5))  # 16
    s2.schedule()
    s2.add("mid-big", params(priority=1, size=128))
    # Pausing the only pausable one (16 tokens) cannot make room for 64: nobody is paused.
    plan = s2.schedule()
    assert set(plan.denoise) == {"high-big", "low-small"} and s2.num_paused == 0


def test_a_request_is_paused_at_most_max_preemptions_times() -> None:
    clock = FakeClock()
    s = scheduler(clock, max_num_seqs=1, max_preemptions=1)
    s.add("batch", params(priority=1, steps=10))
    run_step(s, clock)
    s.add("urgent-1", params(priority=0, steps=1))
    assert run_step(s, clock).denoise == ("urgent-1",)
    assert run_step(s, clock).denoise == ("batch",)  # resumed
    s.add("urgent-2", params(priority=0, steps=1))
    # Paused once already: it runs on, and the urgent request waits for it.
    for _ in range(3):
        assert run_step(s, clock).denoise == ("batch",)
    record = s.get("batch")
    assert record is not None and record.times_paused == 1


def test_aborting_a_paused_request_frees_its_runner_state() -> None:
    clock = FakeClock()
    s = scheduler(clock, max_num_seqs=1)
    s.add("batch", params(priority=1, steps=10))
    run_step(s, clock)
    s.add("urgent", params(priority=0, steps=3))
    run_step(s, clock)
    assert s.num_paused == 1 and s.abort("batch")
    assert "batch" in s.schedule().freed


def measured(s: StepScheduler, clock: FakeClock, seconds: float) -> None:
    """Run a warm-up request so the scheduler measures ``seconds`` per step."""
    s.add("warm", params(steps=3))
    for _ in range(3):
        plan = s.schedule()
        clock.now += seconds
        s.update(plan, RunnerOutput(stepped=list(plan.denoise), decoded=list(plan.decode),
                                    finished={r: "x" for r in plan.decode}))


def test_a_deadline_the_estimate_cannot_meet_is_refused_at_admission() -> None:
    clock = FakeClock()
    config = SchedulerConfig(scheduling_policy="priority", max_batch_tokens=1024)
    queues = RankQueues(ResolvedScheduling.for_family(config), 1, clock=clock)
    s = queues.schedulers[0]
    assert s.estimate_s(params(steps=20)) is None  # nothing measured: nothing refused
    measured(s, clock, 2.0)
    assert s.step_seconds == pytest.approx(2.0)
    assert s.estimate_s(params(steps=20)) == pytest.approx(40.0)
    with pytest.raises(DeadlineError, match=r"deadline_s=30 cannot be met.*40\.0 s") as refused:
        queues.add("tight", params(steps=20, deadline_s=30.0))
    assert refused.value.estimate_s == pytest.approx(40.0)
    queues.add("loose", params(steps=20, deadline_s=45.0))
    # Work queued ahead counts: four 20-step full-budget requests push a lower priority's
    # estimate out (at equal priority, an earlier deadline would go first).
    for i in range(4):
        queues.add(f"ahead-{i}", params(steps=20, size=512))  # 1024 tokens: the whole budget
    with pytest.raises(DeadlineError):
        queues.add("behind", params(steps=20, priority=1, deadline_s=45.0))
    # A higher priority goes before the queued work: it can still make it.
    queues.add("urgent", params(steps=20, priority=-1, deadline_s=60.0))


def test_a_running_request_that_can_no_longer_make_its_deadline_is_stopped() -> None:
    clock = FakeClock()
    s = scheduler(clock, max_num_seqs=2)
    measured(s, clock, 1.0)
    s.add("hopeful", params(steps=10, deadline_s=12.0))
    changes: list[StatusChange] = []
    run_step(s, clock, changes)
    assert changes[-1].eta_s == pytest.approx(9.0)  # 9 steps left at 1 s
    clock.now += 5.0  # a stall: 9 steps from now end 15 s after arrival, past 12
    plan = s.schedule()
    assert "hopeful" in plan.freed and "hopeful" not in plan.denoise
    stopped = s.update(plan, RunnerOutput())
    assert [(c.request_id, c.status) for c in stopped] == \
        [("hopeful", RequestStatus.FINISHED_DEADLINE)]
    assert stopped[0].error is not None and stopped[0].error.startswith("deadline_exceeded")
    assert not s.has_work()


def test_fcfs_with_deadlines_behaves_like_fcfs_until_a_deadline_is_missed() -> None:
    clock = FakeClock()
    s = scheduler(clock, policy="fcfs", max_num_seqs=1)
    s.add("a", params(steps=2))
    s.add("b", params(steps=2, deadline_s=1000.0))
    s.add("c", params(steps=2, deadline_s=1.0))  # waits longer than 1 s: stopped in queue
    changes: list[StatusChange] = []
    order = []
    while s.has_work():
        order.extend(run_step(s, clock, changes).decode)
    assert order == ["a", "b"]
    assert ("c", RequestStatus.FINISHED_DEADLINE) in [(c.request_id, c.status) for c in changes]


def test_data_parallel_shared_queue_hands_by_priority_and_to_a_rank_that_can_pause() -> None:
    clock = FakeClock()
    config = SchedulerConfig(scheduling_policy="priority", max_num_seqs=1)
    queues = RankQueues(ResolvedScheduling.for_family(config), 2, clock=clock)
    queues.add("batch-0", params(priority=1, steps=10))
    queues.add("batch-1", params(priority=2, steps=10))
    for s in queues.schedulers:  # both ranks busy
        s.schedule()
    queues.add("batch-2", params(priority=2))  # pauses nobody: it waits in the shared queue
    queues.add("urgent", params(priority=0))
    # The shared queue hands the urgent request first, to the rank running the worst
    # priority, which pauses it at the next step; the batch request keeps waiting.
    assert queues.is_shared("batch-2") and not queues.is_shared("urgent")
    rank = queues.rank_of("urgent")
    assert rank == queues.rank_of("batch-1")
    assert rank is not None
    plan = queues.schedulers[rank].schedule()
    assert plan.denoise == ("urgent",) and queues.schedulers[rank].num_paused == 1
    fcfs = RankQueues(ResolvedScheduling.for_family(SchedulerConfig(max_num_seqs=1)), 2, clock=clock)
    for rid in ("a", "b"):
        fcfs.add(rid, params(priority=5))
    for s in fcfs.schedulers:
        s.schedule()
    fcfs.add("urgent", params(priority=-5))
    assert fcfs.is_shared("urgent")  # fcfs: it waits for a free slot


def test_an_urgent_request_runs_with_at_most_k_rows_beside_it() -> None:
    """Issue 45 item 14: with urgent_companions K, a step holding an urgent request (priority
    below 0) holds at most K rows of others: running ones beyond K are paused when it is
    admitted, new ones wait, and the batch fills again when it ends."""
    clock = FakeClock()
    s = scheduler(clock, max_num_seqs=4, urgent_companions=1)
    for name in ("bg-a", "bg-b", "bg-c"):
        s.add(name, params(steps=20))
    assert set(run_step(s, clock).denoise) == {"bg-a", "bg-b", "bg-c"}
    s.add("urgent", params(steps=3, priority=-5))
    s.add("bg-d", params(steps=20))
    changes: list[StatusChange] = []
    plan = run_step(s, clock, changes)
    assert "urgent" in plan.denoise
    assert len([r for r in plan.denoise if r != "urgent"]) == 1  # K = 1 row beside it
    assert {c.request_id for c in changes if c.status is RequestStatus.PAUSED} == {"bg-b", "bg-c"}
    while "urgent" not in run_step(s, clock).decode:
        assert s.num_running <= 2
    after = run_step(s, clock)
    assert len(after.denoise) == 4  # the urgent request ended: the batch fills again
    # Without the knob the urgent request only goes first: nobody is paused for it.
    clock = FakeClock()
    s = scheduler(clock, max_num_seqs=4)
    for name in ("bg-a", "bg-b", "bg-c"):
        s.add(name, params(steps=20))
    run_step(s, clock)
    s.add("urgent", params(steps=3, priority=-5))
    assert len(run_step(s, clock).denoise) == 4


def test_urgent_companions_is_a_checked_option() -> None:
    from ditserve.engine.config import EngineConfig
    from ditserve.engine.errors import ConfigError

    assert EngineConfig.from_mapping({"scheduler": {"urgent_companions": 2}}
                                     ).scheduler.urgent_companions == 2
    with pytest.raises(ConfigError, match="urgent_companions"):
        EngineConfig.from_mapping({"scheduler": {"urgent_companions": -1}})
