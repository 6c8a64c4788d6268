"""bench/priority_replay.py: the StepScheduler over a priority trace on a step-time model
(issue 47). Its numbers are only as good as its model; these tests pin the bookkeeping: every
request is served, an idle request costs encode + steps + decode, and the urgent-companion
bound is what the replay shows for an urgent request arriving into a full batch."""

from __future__ import annotations

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
