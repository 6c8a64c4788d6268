"""InFlightSteps: at once on the CPU; on a GPU (faked events) one close later, flushed when idle."""

from __future__ import annotations

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
