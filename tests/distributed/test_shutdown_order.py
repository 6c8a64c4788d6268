"""Rank 0 tears its process groups down while the workers tear down theirs.

NCCL's destroy_process_group returns only once every rank has called it. A worker that got
Stop sits in its destroy until rank 0 calls its own, so rank 0 must not wait for the workers
to exit first (on 2x H200 that cost the whole 30 s join timeout per shutdown).
"""

from __future__ import annotations

import threading

import pytest

from ditserve.engine.distributed import executor as executor_module


class WorkerInDestroy:
    """A worker process that exits only after rank 0 has called destroy (as with NCCL)."""

    def __init__(self, rank0_destroyed: threading.Event) -> None:
        self.rank0_destroyed = rank0_destroyed
        self.exited_cleanly = False

    def join(self, timeout: float | None = None) -> None:
        self.exited_cleanly = self.rank0_destroyed.wait(timeout)

    def is_alive(self) -> bool:
        return not self.exited_cleanly

    def kill(self) -> None:
        pass


class Runner:
    closed = False

    def close(self) -> None:
        self.closed = True


def test_rank0_destroys_its_group_while_workers_destroy_theirs(monkeypatch: pytest.MonkeyPatch) -> None:
    destroyed = threading.Event()
    monkeypatch.setattr(executor_module, "destroy", destroyed.set)
    worker = WorkerInDestroy(destroyed)
    runner = Runner()
    # The worker already has its Stop: what is left is the teardown of both sides.
    executor_module.tear_down_rank0(runner, {1: worker})
    assert worker.exited_cleanly, "the worker was left waiting for rank 0's destroy"
    assert runner.closed
