"""ThreadSamples: where threads were between two steps, and the step log line that says so."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from ditserve.engine.loop.step_log import StepLog
from ditserve.engine.loop.thread_samples import ThreadSamples, is_ours, short_path


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))  # busy in this file's own function


def test_a_busy_thread_is_named_by_its_function_and_an_idle_one_is_left_out() -> None:
    stop = threading.Event()
    busy = threading.Thread(target=_spin, args=(stop,), name="busy-worker")
    parked = threading.Thread(target=stop.wait, name="parked-worker")
    busy.start()
    parked.start()
    samples = ThreadSamples(interval_s=0.002)
    try:
        start = time.monotonic()
        for _ in range(20):
            samples.sample()
            time.sleep(0.002)
        end = time.monotonic()
    finally:
        stop.set()
        busy.join()
        parked.join()
    counts = samples.between(start, end)
    assert sum(counts["busy-worker"].values()) == 20
    assert all("_spin" in place for place in counts["busy-worker"])  # its own frame, always
    assert set(counts["parked-worker"]) == {"idle"}
    line = samples.describe(start, end)
    assert "busy-worker (20 samples): " in line and "_spin" in line
    assert "parked-worker" not in line
    assert samples.describe(end + 1, end + 2) == "every thread idle"


def test_samples_older_than_keep_s_are_dropped() -> None:
    now = [0.0]
    samples = ThreadSamples(keep_s=1.0, clock=lambda: now[0])
    for t in (0.0, 0.5, 1.2, 2.0):
        now[0] = t
        samples.sample()
    assert samples.between(0.0, 0.9) == {}  # 0.0 and 0.5 fell out of the window at 2.0
    assert samples.between(1.1, 2.0)


def test_the_background_thread_samples_until_stopped() -> None:
    samples = ThreadSamples(interval_s=0.005)
    samples.keep_running()
    time.sleep(0.1)
    samples.stop()
    assert samples.between(0.0, time.monotonic() + 1)  # the main thread, at least
    assert not any(t.name == "ditserve-thread-samples" for t in threading.enumerate())


def test_paths_read_from_the_package_folder() -> None:
    assert short_path("/usr/lib/python3/site-packages/torch/nn/modules/module.py") == \
        "torch/nn/modules/module.py"
    assert short_path("/srv/app/ditserve/engine/loop/engine.py") == "ditserve/engine/loop/engine.py"
    assert short_path("/usr/lib/python3.12/threading.py") == "threading.py"
    assert is_ours("/x/site-packages/ditserve/engine/loop/engine.py")
    assert is_ours("/checkout/engine/runner/model_runner.py")
    assert not is_ours("/x/site-packages/sqlalchemy/engine/base.py")


def test_a_slow_gap_between_steps_logs_where_the_threads_were(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    samples = ThreadSamples(interval_s=3600.0, clock=lambda: now[0])  # sampled by hand here
    steps = StepLog(10.0, clock=lambda: now[0], logger=logging.getLogger("test.stalls"),
                    samples=samples)
    caplog.set_level(logging.DEBUG, logger="test.stalls")
    steps.on_step(requests=1, rows=1, seconds=0.1)
    for t in (0.2, 0.4, 0.6):  # sampled between the steps (this thread: in the test)
        now[0] = t
        samples.sample()
    now[0] = 0.8
    steps.on_step(requests=1, rows=1, seconds=0.3)  # 0.8 s since, 0.3 s of it the forward
    now[0] = 1.0
    steps.on_step(requests=1, rows=1, seconds=0.15)  # 0.2 s since: within STALL_S of it
    stalls = [r.getMessage() for r in caplog.records if "beyond the forward" in r.getMessage()]
    assert len(stalls) == 1
    assert stalls[0].startswith("between the last two steps, 500 ms beyond the forward: ")
    assert "MainThread (3 samples): " in stalls[0]
    samples.stop()


def test_the_sampling_thread_stops_when_no_step_keeps_it_running() -> None:
    samples = ThreadSamples(interval_s=0.005, keep_s=0.05)
    samples.keep_running()
    assert any(t.name == "ditserve-thread-samples" for t in threading.enumerate())
    time.sleep(0.3)  # no step: it stops by itself
    assert not any(t.name == "ditserve-thread-samples" for t in threading.enumerate())
    samples.keep_running()  # the next step starts it again
    assert any(t.name == "ditserve-thread-samples" for t in threading.enumerate())
    samples.stop()
