"""StepLog: periodic step summaries, never averaging an idle gap in."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from ditserve.engine.loop.step_log import StepLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_summarizes_each_interval_and_skips_idle_gaps(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    steps = StepLog(10.0, clock=clock, logger=logging.getLogger("test.steps"))
    caplog.set_level(logging.INFO, logger="test.steps")
    for i in range(5):  # 0, 2, ..., 8 s: 0.2 s steps at batch 2, in two shape groups
        clock.now = 2.0 * i
        steps.on_step(requests=2, rows=4, seconds=0.2, groups=2, tokens=8192 + 512 * i)
    clock.now = 9.0
    steps.on_finished(SimpleNamespace(num_images=3, request_id="r", queue_seconds=0.0))
    clock.now = 10.5  # the interval is over: the next step (from 10.1 s) closes the window
    steps.on_step(requests=1, rows=1, seconds=0.4, groups=1, tokens=4096)
    assert [r.getMessage() for r in caplog.records] == [
        "5 steps in 10.3 s: step 200 ms mean (min 200, max 200), batch 2.00 requests / "
        "4.00 rows / 2.00 shape groups / 9216 tokens, 3 images finished, 0 requests failed"]
    caplog.clear()
    clock.now = 500.0  # after a long idle gap: the window ended at its last event
    steps.on_failed("r", "boom")
    assert [r.getMessage() for r in caplog.records] == [  # from the step's start (10.1 s)
        "1 steps in 0.4 s: step 400 ms mean (min 400, max 400), batch 1.00 requests / "
        "1.00 rows / 1.00 shape groups / 4096 tokens, 0 images finished, 0 requests failed"]


def test_nothing_is_logged_before_an_interval_has_passed(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    steps = StepLog(10.0, clock=clock, logger=logging.getLogger("test.steps2"))
    caplog.set_level(logging.INFO, logger="test.steps2")
    for i in range(9):
        clock.now = float(i)
        steps.on_step(requests=1, rows=1, seconds=0.1)
    assert caplog.records == []


def test_appends_each_ranks_copy_rate_when_offload_copies_are_timed(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    rates: list[float | None] = [55.12, 51.9]
    steps = StepLog(10.0, clock=clock, logger=logging.getLogger("test.steps3"),
                    copy_rates=lambda: rates)
    caplog.set_level(logging.INFO, logger="test.steps3")
    steps.on_step(requests=1, rows=1, seconds=0.23)
    clock.now = 11.0
    steps.on_step(requests=1, rows=1, seconds=0.23)
    assert caplog.records[-1].getMessage().endswith(
        "0 requests failed, H2D 55.1/51.9 GB/s (ranks 0/1)")
    rates[:] = [None]  # nothing timed yet (or no offload): no suffix
    clock.now = 22.0
    steps.on_step(requests=1, rows=1, seconds=0.23)
    assert caplog.records[-1].getMessage().endswith("0 requests failed")


def test_a_failing_rate_source_does_not_break_the_line(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> list[float | None]:
        raise RuntimeError("engine stopped")

    clock = Clock()
    steps = StepLog(10.0, clock=clock, logger=logging.getLogger("test.steps4"), copy_rates=broken)
    caplog.set_level(logging.INFO, logger="test.steps4")
    steps.on_step(requests=1, rows=1, seconds=0.2)
    clock.now = 11.0
    steps.on_step(requests=1, rows=1, seconds=0.2)
    assert caplog.records[-1].getMessage().endswith("0 requests failed")


def test_copy_rates_of_an_engine_report() -> None:
    from ditserve.engine.loop.step_log import copy_rates_of

    assert copy_rates_of(None) == []
    assert copy_rates_of({"h2d_gbps_recent": 54.0}) == [54.0]
    assert copy_rates_of({"h2d_gbps_recent": 54.0,
                          "ranks": [{"h2d_gbps_recent": 54.0}, None]}) == [54.0, None]


def test_at_debug_every_step_pause_resume_and_finish_is_a_line(
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 47: the per-step lines put each step's forward time beside the wall time since
    the step before, and the pauses, resumes and finishes between them, in order."""
    clock = Clock()
    steps = StepLog(10.0, clock=clock, logger=logging.getLogger("test.steps_debug"))
    caplog.set_level(logging.DEBUG, logger="test.steps_debug")
    clock.now = 1.0
    steps.on_step(requests=5, rows=5, seconds=0.7, groups=3, tokens=15584)
    steps.on_preempted("4")
    clock.now = 1.5
    steps.on_step(requests=2, rows=2, seconds=0.3, groups=2, tokens=8176)
    clock.now = 1.6
    steps.on_resumed("4", 0.6)
    steps.on_finished(SimpleNamespace(num_images=1, request_id="0", queue_seconds=0.25))
    assert [r.getMessage() for r in caplog.records] == [
        "step: 5 requests / 5 rows / 3 shape groups / 15584 tokens, forward 700.0 ms, "
        "- ms since the last step",
        "paused 4",
        "step: 2 requests / 2 rows / 2 shape groups / 8176 tokens, forward 300.0 ms, "
        "500.0 ms since the last step",
        "resumed 4 after 0.600 s",
        "finished 0 (queued 0.250 s)"]
    assert all(r.levelno == logging.DEBUG for r in caplog.records)  # INFO sees no new line
