"""PlanPoint on CUDA (run on the device machine): ``wait`` returns once the GPU has run every
block before the plan point, and the step's later blocks are still queued behind it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ditserve.engine.runner.plan_point import PlanPoint

pytestmark = pytest.mark.gpu


class Heavy(nn.Module):
    """Ten blocks, each a chain of large matmuls, so a forward queues far ahead of the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4096, 4096, device="cuda") for _ in range(10))

    def forward(self, x: torch.Tensor, marks: list[torch.cuda.Event]) -> torch.Tensor:
        for block in self.blocks:
            for _ in range(8):
                x = block(x)
            marks.append(torch.cuda.Event())
            marks[-1].record()  # after this block's work, in stream order
        return x


def test_wait_returns_when_the_blocks_before_the_point_have_run() -> None:
    model = Heavy()
    point = PlanPoint(model, ("blocks",), 0.8, device=torch.device("cuda"))
    assert point.block_index == 8
    marks: list[torch.cuda.Event] = []
    with torch.no_grad():
        model(torch.randn(8192, 4096, device="cuda"), marks)  # queued, not run
        point.wait()
    # Stream order: the point was recorded after block 7's work, so all of that is done.
    assert all(mark.query() for mark in marks[:8])
    torch.cuda.synchronize()
    point.close()
