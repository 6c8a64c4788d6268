"""InFlightSteps: at once on the CPU; on a GPU (faked events) one close later, flushed when idle."""

from __future__ import annotations

import logging

import pytest
import torch

from ditserve.engine.runner.inflight import InFlightSteps


def test_cpu_steps_complete_at_close_with_their_forward_and_decodes() -> None:
    steps = InFlightSteps(torch.device("cpu"))
    steps.forward_started()
    steps.forward_ended(requests=2, rows=3)
    steps.add_decode("a", "pixels of a")
    (done,) = steps.close()
    assert (done.requests, done.rows, done.decodes) == (2, 3, {"a": "pixels of a"})
    assert done.seconds >= 0.0
    assert steps.num_queued == 0


def test_forgotten_decode_is_never_handed_back() -> None:
    steps = InFlightSteps(torch.device("cpu"))
    steps.add_decode("a", "pixels of a")
    steps.add_decode("b", "pixels of b")
    steps.forget("a")
    (done,) = steps.close()
    assert done.decodes == {"b": "pixels of b"} and done.rows == 0


def test_a_step_without_work_still_completes() -> None:
    (done,) = InFlightSteps(torch.device("cpu")).close()
    assert done.decodes == {} and done.rows == 0


class FakeEvent:
    """Stands in for torch.cuda.Event: records when it was waited on."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.waited = False

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        self.waited = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return 250.0


def test_on_a_gpu_a_step_completes_one_close_later_and_an_idle_close_flushes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    steps = InFlightSteps(torch.device("cuda", 0))
    steps.forward_started()
    steps.forward_ended(requests=1, rows=1)
    steps.add_decode("a", "pixels of a")
    assert steps.close() == []  # queued: the host runs one step ahead
    steps.forward_started()
    steps.forward_ended(requests=2, rows=2)
    (first,) = steps.close()  # waits for the first step only
    assert first.decodes == {"a": "pixels of a"} and first.seconds == 0.25
    assert steps.num_queued == 1
    second, idle = steps.close()  # nothing queued this time: wait for everything
    assert (second.requests, second.rows) == (2, 2) and steps.num_queued == 0
    assert idle.rows == 0 and not idle.decodes


def test_on_a_gpu_a_collective_only_pass_keeps_the_host_one_step_ahead(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    steps = InFlightSteps(torch.device("cuda", 0))
    steps.work_queued()  # an idle rank's pass of gathers
    assert steps.close() == []
    steps.work_queued()
    assert len(steps.close()) == 1 and steps.num_queued == 1


def test_at_debug_a_completed_step_logs_its_encode_and_decode_times(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Time between forwards is named: each completed step's encode and decode, GPU time by
    its events and the host's queuing time, logged when the step completes (one close later)."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    steps = InFlightSteps(torch.device("cuda", 0))
    with caplog.at_level(logging.DEBUG, logger="ditserve.engine.runner.inflight"):
        with steps.timed_part("encode", 3):
            pass
        steps.forward_started()
        steps.forward_ended(requests=3, rows=3)
        with steps.timed_part("decode", 0):  # nothing decoded: no part
            pass
        assert steps.close() == [] and not caplog.records  # still queued
        steps.forward_started()
        steps.forward_ended(requests=3, rows=3)
        steps.close()
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith("step parts besides the forward: encode 3 in 250.0 ms (host ")
    assert "decode" not in message


def test_parts_are_timed_only_where_debug_logging_is_on(
        caplog: pytest.LogCaptureFixture) -> None:
    steps = InFlightSteps(torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="ditserve.engine.runner.inflight"):
        with steps.timed_part("decode", 2):
            pass
        steps.close()
    assert not caplog.records
    with caplog.at_level(logging.DEBUG, logger="ditserve.engine.runner.inflight"):
        with steps.timed_part("decode", 2):
            pass
        steps.close()  # on the CPU a step completes at once; the host's time is its time
    (record,) = caplog.records
    assert record.getMessage().startswith("step parts besides the forward: decode 2 in ")
