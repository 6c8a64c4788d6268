"""Where a replica's start goes: the timeline's bookkeeping (injected clock), and a real tiny
engine on CPU reporting its phases in the log and on /metrics."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ditserve.engine.config import EngineConfig, SchedulerConfig
from ditserve.engine.loop.engine import DiffusionEngine
from ditserve.engine.runner.start_phases import StartTimeline, process_age_s


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_phases_add_up_and_ready_counts_from_process_start() -> None:
    clock = Clock()
    timeline = StartTimeline(clock=clock, process_age=lambda: 2.0)
    with timeline.phase("read"):
        clock.now += 3.0
    with timeline.phase("warm_up"):
        clock.now += 0.5
    with timeline.phase("warm_up"):  # a phase that runs twice adds up
        clock.now += 0.25
    assert timeline.report() == {"phases": {"process": 2.0, "read": 3.0, "warm_up": 0.75},
                                 "start_to_ready_s": None}
    clock.now += 1.0  # untimed work: in the total, not in a phase
    assert timeline.ready() == pytest.approx(2.0 + 4.75)
    assert timeline.report()["start_to_ready_s"] == pytest.approx(6.75)
    with pytest.raises(ValueError, match="unknown start phase"), timeline.phase("lunch"):
        pass


def test_a_failing_phase_is_still_timed() -> None:
    clock = Clock()
    timeline = StartTimeline(clock=clock, process_age=lambda: None)
    with pytest.raises(RuntimeError), timeline.phase("read"):
        clock.now += 1.5
        raise RuntimeError("disk gone")
    assert timeline.report()["phases"] == {"read": 1.5}


def test_process_age_is_known_on_linux() -> None:
    age = process_age_s()
    assert age is not None and age > 0


def test_a_tiny_engine_reports_its_start_in_the_log_and_metrics(
        tiny_model_dir, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.server.metrics import ServingMetrics

    caplog.set_level(logging.INFO, logger="ditserve.engine.runner.start_phases")
    engine = DiffusionEngine(EngineConfig(model=str(tiny_model_dir), device="cpu",
                                          scheduler=SchedulerConfig(max_num_seqs=1)))
    engine.start()
    try:
        report = engine.start_report()
        assert ({"process", "imports", "read", "place", "encoders", "warm_up"}
                <= set(report["phases"]))
        assert "cuda_init" not in report["phases"] and "compile" not in report["phases"]
        assert report["start_to_ready_s"] >= sum(report["phases"].values()) - 1e-6
        assert any(r.getMessage().startswith("ready ") and "read " in r.getMessage()
                   for r in caplog.records)
        metrics = ServingMetrics(lambda: engine)
        families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
        phases = {s.labels["phase"]: s.value
                  for s in families["ditserve:start_phase_seconds"].samples}
        assert phases == pytest.approx(report["phases"])
        (total,) = families["ditserve:start_to_ready_seconds"].samples
        assert total.value == pytest.approx(report["start_to_ready_s"])
    finally:
        engine.shutdown()
