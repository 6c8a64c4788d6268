"""StepLog: periodic step summaries, never averaging an idle gap in."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from ditserve.engine.step_log import StepLog


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_summarizes_each_interval_and_skips_idle_gaps(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    steps = StepLog(10.0, clock=clock, logger=logging.getLogger("test.steps"))
    caplog.set_level(logging.INFO, logger="test.steps")
    for i in range(5):  # 0, 2, ..., 8 s: 0.2 s steps at batch 2
        clock.now = 2.0 * i
        steps.on_step(requests=2, rows=4, seconds=0.2)
    clock.now = 9.0
    steps.on_finished(SimpleNamespace(num_images=3))
    clock.now = 10.5  # the interval is over: the next event closes the window
    steps.on_step(requests=1, rows=1, seconds=0.4)
    assert [r.getMessage() for r in caplog.records] == [
        "5 steps in 10.5 s: step 200 ms mean (min 200, max 200), batch 2.00 requests / "
        "4.00 rows, 3 images finished, 0 requests failed"]
    caplog.clear()
    clock.now = 500.0  # after a long idle gap: the window ended at its last event
    steps.on_failed("r", "boom")
    assert [r.getMessage() for r in caplog.records] == [
        "1 steps in 0.0 s: step 400 ms mean (min 400, max 400), batch 1.00 requests / "
        "1.00 rows, 0 images finished, 0 requests failed"]


def test_nothing_is_logged_before_an_interval_has_passed(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    steps = StepLog(10.0, clock=clock, logger=logging.getLogger("test.steps2"))
    caplog.set_level(logging.INFO, logger="test.steps2")
    for i in range(9):
        clock.now = float(i)
        steps.on_step(requests=1, rows=1, seconds=0.1)
    assert caplog.records == []
