"""The CUDA context is made on its own thread while the weights are read
(``assembly.context_meanwhile``): both run at once, the phase is recorded, a failure of either
reaches the caller, and nothing happens for the CPU. A fake context maker stands in for CUDA."""

from __future__ import annotations

import threading

import pytest
import torch

from ditserve.engine.runner.assembly import context_meanwhile
from ditserve.engine.runner.start_phases import StartTimeline

CUDA = torch.device("cuda", 0)  # only named: the fake maker never touches a device


def test_the_context_is_made_while_the_body_runs() -> None:
    body_started, made = threading.Event(), []

    def make(device: torch.device) -> None:
        # Finishes only once the body has started: the two overlap, or this test times out.
        assert body_started.wait(timeout=60)
        made.append((device, threading.current_thread().name))

    timeline = StartTimeline(process_age=lambda: None)
    with context_meanwhile(CUDA, timeline, make_context=make):
        body_started.set()
    assert made == [(CUDA, "cuda-context")]  # done by the time the block is left
    assert "cuda_init" in timeline.report()["phases"]


def test_a_failed_context_is_raised_after_the_body() -> None:
    def refuse(device: torch.device) -> None:
        raise RuntimeError("no CUDA-capable device is detected")

    ran = []
    with pytest.raises(RuntimeError, match="no CUDA-capable device"), \
            context_meanwhile(CUDA, make_context=refuse):
        ran.append(True)
    assert ran == [True]


def test_the_body_failure_wins_and_the_thread_is_joined() -> None:
    body_started, finished = threading.Event(), threading.Event()

    def slow(device: torch.device) -> None:
        assert body_started.wait(timeout=60)  # still running when the body fails
        finished.set()

    with pytest.raises(ValueError, match="bad weights"), \
            context_meanwhile(CUDA, make_context=slow):
        body_started.set()
        raise ValueError("bad weights")
    assert finished.is_set()


def test_nothing_runs_for_the_cpu() -> None:
    def never(device: torch.device) -> None:
        raise AssertionError("no context for the CPU")

    with context_meanwhile(torch.device("cpu"), make_context=never):
        pass
