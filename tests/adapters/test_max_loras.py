"""``--max-loras N`` as a strict bound: a step's requests name at most N distinct adapters, so
the runner never holds more than N resident. A request whose adapters do not fit waits in its
order (nothing lost, no deadlock) while the others run; under the priority policy a paused
request keeps its adapters, so nobody is paused for adapters' room. Pure scheduler checks,
then a tiny Flux runner: resident adapters never exceed N, and every request equals its solo
run. (A request stacking more than N adapters is refused at validation: test_server.py.)"""

from __future__ import annotations

import pytest
import torch
from adapters.test_runner_modes import make_runner, ref  # type: ignore[import-not-found]
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import SchedulerConfig
from ditserve.engine.config.adapters import AdapterConfig
from ditserve.engine.request import LoraRef, SamplingParams
from ditserve.engine.sched.scheduler import StepScheduler
from ditserve.engine.sched.work import ResolvedScheduling
from ditserve.engine.step.plan import RunnerOutput, StepPlan


def resolved(*, max_loras: int | None = None, **kw: object) -> ResolvedScheduling:
    return ResolvedScheduling.for_family(SchedulerConfig(**kw),  # type: ignore[arg-type]
                                         max_loras=max_loras)


def with_loras(*names: str, steps: int = 3, priority: int = 0) -> SamplingParams:
    return SamplingParams(prompt="p", num_inference_steps=steps, height=64, width=64,
                          priority=priority,
                          loras=tuple(LoraRef(n, f"/{n}.safetensors", rank=4) for n in names))


def run(s: StepScheduler, limit: int) -> tuple[list[StepPlan], list[str]]:
    """Step a perfect runner to the end; every step's requests (and the paused ones, whose
    adapters the runner keeps) name at most ``limit`` adapters."""
    plans, finished = [], []
    while s.has_work():
        assert len(plans) < 100, "deadlock: the scheduler stopped making progress"
        plan = s.schedule()
        held = {rid: s.get(rid) for rid in plan.denoise}
        names = {ref.name for r in held.values() if r for ref in r.params.loras}
        assert len(names) <= limit, f"step {plan.step_id} holds {names}"
        out = RunnerOutput(stepped=list(plan.denoise), decoded=list(plan.decode))
        out.finished = {r: "pixels" for r in out.decoded}
        s.update(plan, out)
        plans.append(plan)
        finished.extend(out.decoded)
    return plans, finished


def test_a_step_admits_the_requests_whose_adapters_fit() -> None:
    s = StepScheduler(resolved(max_num_seqs=8, max_loras=2))
    for rid, names in [("a", ("a",)), ("b", ("b",)), ("c", ("c",)), ("none", ()),
                       ("a2", ("a",)), ("ab", ("a", "b"))]:
        s.add(rid, with_loras(*names))
    plans, finished = run(s, limit=2)
    assert plans[0].encode == ("a", "b", "none", "a2", "ab")  # c waits, the others pass it
    assert sorted(finished) == sorted(["a", "b", "c", "none", "a2", "ab"])  # nothing lost
    assert next(p.step_id for p in plans if "c" in p.encode) > 0


def test_strict_order_waits_for_the_adapters_to_free() -> None:
    s = StepScheduler(resolved(max_num_seqs=8, max_loras=1, max_bypass=0))
    for rid, names, steps in [("a", ("a",), 2), ("b", ("b",), 3), ("none", (), 1),
                              ("a2", ("a",), 1)]:
        s.add(rid, with_loras(*names, steps=steps))
    plans, finished = run(s, limit=1)
    admitted = [rid for p in plans for rid in p.encode]
    assert admitted == ["a", "b", "none", "a2"]  # FIFO: b blocks everyone behind it
    assert plans[0].encode == ("a",)
    assert finished.index("a") < finished.index("b")


def test_priority_never_pauses_for_adapters_and_never_deadlocks() -> None:
    s = StepScheduler(resolved(max_num_seqs=2, max_loras=1, scheduling_policy="priority"))
    s.add("low", with_loras("a", steps=4, priority=5))
    first = s.schedule()
    out = RunnerOutput(stepped=list(first.denoise))
    s.update(first, out)
    s.add("high", with_loras("b", steps=2, priority=0))  # does not fit beside a
    s.add("other", with_loras("a", steps=2, priority=1))  # fits beside a
    plans, finished = run(s, limit=1)
    assert s.num_paused == 0 and all("high" not in p.denoise for p in plans[:3])
    assert plans[0].encode == ("other",)
    assert sorted(finished) == ["high", "low", "other"]


def test_unbounded_without_max_loras() -> None:
    s = StepScheduler(resolved(max_num_seqs=8))
    for name in "abcdefg":
        s.add(name, with_loras(name))
    assert len(s.schedule().encode) == 7


def test_resident_adapters_never_exceed_max_loras(adapter_models, lora_files) -> None:  # type: ignore[no-untyped-def]
    files = lora_files("flux")
    runner = make_runner(adapter_models("flux"), files, adapters=AdapterConfig(
        lora_modules={name: str(path) for name, path in files.items()}, max_loras=2))
    assert len(runner.adapters.resident) == 2 and runner.adapters.nbytes > 0

    def p(prompt: str, *loras: LoraRef) -> SamplingParams:
        return SamplingParams(prompt=prompt, seed=len(prompt), num_inference_steps=2,
                              height=32, width=32, loras=loras)

    step = [("a", p("a cat", ref(runner, "a"))), ("kohya", p("a dog", ref(runner, "kohya"))),
            ("b", p("a fox", ref(runner, "b", 0.7))), ("none", p("a tree")),
            ("ab", p("a ship", ref(runner, "a"), ref(runner, "b")))]
    plans: list[StepPlan] = []
    got, _ = drive(runner, {0: step}, config=resolved(max_num_seqs=8, max_loras=2),
                   max_num_seqs=8, plans=plans)
    assert runner.adapters.peak_resident <= 2
    assert set(got) == {rid for rid, _ in step}  # every request ran: no deadlock, none lost
    assert plans[0].encode == ("a", "kohya", "none")  # b and ab wait for the room
    alone = {}
    for rid, params in step:
        alone[rid] = drive(runner, {0: [(rid, params)]}, max_num_seqs=1)[0][rid]
        diff = (got[rid] - alone[rid]).abs().max().item()
        assert diff <= 1e-4, f"{rid}: {diff}"
    assert runner.adapters.peak_resident <= 2 and runner.adapters.loads > 3  # re-read
    # an adapter evicted and read again gives the result it gave before
    again, _ = drive(runner, {0: [("a", step[0][1])]}, max_num_seqs=1)
    assert torch.equal(again["a"], alone["a"])


@pytest.mark.parametrize("limit", [1, 3])
def test_the_start_loads_up_to_max_loras(adapter_models, lora_files, limit: int) -> None:  # type: ignore[no-untyped-def]
    files = lora_files("flux")
    runner = make_runner(adapter_models("flux"), files, adapters=AdapterConfig(
        lora_modules={name: str(path) for name, path in files.items()}, max_loras=limit))
    assert len(runner.adapters.resident) == min(limit, len(files))
