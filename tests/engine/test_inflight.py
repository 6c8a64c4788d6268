"""InFlightSteps on the CPU: nothing is queued, so every step completes when it is closed."""

from __future__ import annotations

import torch

from ditserve.engine.inflight import InFlightSteps


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
