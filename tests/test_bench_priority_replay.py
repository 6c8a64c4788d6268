"""bench/priority_replay.py: the StepScheduler over a priority trace on a step-time model
(issue 47). Its numbers are only as good as its model; these tests pin the bookkeeping: every
request is served, an idle request costs encode + steps + decode, and the urgent-companion
bound is what the replay shows for an urgent request arriving into a full batch."""

from __future__ import annotations

import pytest
from test_bench_tools import load  # type: ignore[import-not-found]

from ditserve.engine.config import SchedulerConfig

MODEL_MS = {"base_ms": 0.0, "ms_per_ktoken": 100.0, "encode_ms": 50.0,
            "decode_ms_per_mpixel": 0.0}


def test_an_idle_request_costs_its_encode_and_its_steps() -> None:
    bench = load("priority_replay")
    model = bench.StepModel(**MODEL_MS)
    done = bench.replay([bench.Arrival(0.0, -1, "1024x1024")], 4, model, SchedulerConfig())
    # 4096 tokens at 0.1 ms each = 0.41 s a step, four steps, one 50 ms encode.
    assert abs(done["0"] - (4 * 0.4096 + 0.05)) < 1e-9


def test_an_urgent_request_into_a_full_batch_runs_alone_under_zero_companions() -> None:
    bench = load("priority_replay")
    model = bench.StepModel(**MODEL_MS)
    trace = [bench.Arrival(0.0, 1, "1024x1024") for _ in range(4)]
    trace.append(bench.Arrival(0.01, -1, "1024x1024"))
    def run(companions: int | None, lookahead: int) -> dict[str, float]:
        return bench.replay(trace, 4, model, SchedulerConfig(
            max_num_seqs=8, scheduling_policy="priority", urgent_companions=companions),
            lookahead=lookahead)

    assert len(run(0, 0)) == len(run(None, 1)) == 5  # everybody is served
    first = 4 * 0.4096 + 4 * 0.05  # the step of four rows (and their encodes) it arrived in
    alone = 4 * 0.4096 + 0.05
    assert abs(run(0, 0)["4"] - (first - 0.01 + alone)) < 1e-9
    # The engine's loop planned the next four-row step before it arrived: one more step.
    assert abs(run(0, 1)["4"] - (first - 0.01 + 4 * 0.4096 + alone)) < 1e-9
    assert run(None, 0)["4"] > run(0, 0)["4"]  # unbounded: it shares its steps with four rows


def test_the_forward_fit_reads_the_step_log_and_recovers_its_line() -> None:
    """--fit-log: the engine's step summaries (warm-up window left out) through a known line
    (5 ms + 40 ms a ktoken) give that line back, and the time outside the forwards."""
    bench = load("priority_replay")
    line = ("2026-12-06 01:37:03,964 INFO ditserve.engine.steps: {n} steps in {wall} s: step "
            "{ms} ms mean (min 151, max 1269), batch 3.79 requests / 3.79 rows / 1.00 shape "
            "groups / {tok} tokens, 1 images finished, 0 requests failed")
    text = "\n".join([line.format(n=14, wall=10.9, ms=999, tok=1000),  # warm-up: skipped
                      "INFO ditserve.engine.server.state: engine ready: serving zimage",
                      line.format(n=10, wall=10.0, ms=5 + 40 * 8.0, tok=8000),
                      line.format(n=20, wall=12.0, ms=5 + 40 * 12.5, tok=12500)])
    windows = bench.log_windows(text)
    assert [w.steps for w in windows] == [10, 20]
    assert abs(windows[0].outside_s - (10.0 - 10 * 0.325)) < 1e-9
    base, slope = bench.fit_forward(windows)
    assert abs(base - 5.0) < 1e-9 and abs(slope - 40.0) < 1e-9


def test_the_schedule_free_bound_runs_the_urgent_requests_own_work_in_arrival_order() -> None:
    bench = load("priority_replay")
    model = bench.StepModel(**MODEL_MS)
    one = bench.own_work_s(model, bench.Arrival(0.0, -1, "1024x1024"), 4)
    # 4 steps x 4096 tokens x 0.1 ms, one 50 ms encode, one 1024x1024 decode; no step base.
    assert one == pytest.approx((4 * 409.6 + MODEL_MS["encode_ms"]
                                 + MODEL_MS["decode_ms_per_mpixel"]) / 1000)
    apart = [bench.Arrival(0.0, -1, "1024x1024"), bench.Arrival(10.0, -1, "1024x1024")]
    assert bench.largest_latency_bound(apart, 4, model) == pytest.approx(one)
    together = [bench.Arrival(0.0, -1, "1024x1024"), bench.Arrival(0.5 * one, -1, "1024x1024")]
    # The second waits for the first's work: it ends at 2 x one, half of one after arriving.
    assert bench.largest_latency_bound(together, 4, model) == pytest.approx(1.5 * one)
    # No schedule the replay finds beats it.
    done = bench.replay(together, 4, model, SchedulerConfig(scheduling_policy="priority"))
    assert max(done.values()) >= bench.largest_latency_bound(together, 4, model)


def test_planning_late_lets_an_early_arrival_into_the_next_step() -> None:
    bench = load("priority_replay")
    model = bench.StepModel(**MODEL_MS)
    trace = [bench.Arrival(0.0, 1, "1024x1024") for _ in range(4)]
    trace.append(bench.Arrival(0.01, -1, "1024x1024"))
    config = SchedulerConfig(max_num_seqs=8, scheduling_policy="priority", urgent_companions=0)
    first = 4 * 0.4096 + 4 * 0.05  # the four-row step running when it arrives
    alone = 4 * 0.4096 + 0.05
    # Planned at 80% of the running step, after its arrival: the very next step is its own.
    late = bench.replay(trace, 4, model, config, plan_at=0.8)
    assert abs(late["4"] - (first - 0.01 + alone)) < 1e-9
    assert late["4"] < bench.replay(trace, 4, model, config)["4"]  # planned at the step's start
