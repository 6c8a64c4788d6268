"""Filling the host slabs at enable (``builders.fill``): several threads give the same slabs
as one, each block's bytes in its own slab, and a failing block stops the fill with its error."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import torch
from offload.support import build_flux  # type: ignore[import-not-found]

from ditserve.engine.config import OffloadConfig
from ditserve.engine.offload import builders
from ditserve.engine.offload.discovery import discover
from ditserve.engine.offload.host.memory import PageableMemory
from ditserve.engine.offload.host.slabs import SlabBacking
from ditserve.engine.offload.plan import BlockLayout


def split_of(model: torch.nn.Module) -> builders.ModelSplit:
    return builders.split_model(model, discover(model, None), OffloadConfig(enabled=True),
                                slots=2, group_size=1, activation_reserve_bytes=0)


def test_threads_fill_the_same_slabs_as_one() -> None:
    model = build_flux()
    split = split_of(model)
    assert len(split.plan.streamed) > 2
    one, many = SlabBacking(PageableMemory()), SlabBacking(PageableMemory())
    builders.fill(one, split, workers=1)
    builders.fill(many, split, workers=4)
    for index in split.plan.streamed:  # every tensor's bytes where its view says
        for mine, theirs, tensor in zip(many.tensor_views(index), one.tensor_views(index),
                                        split.block_tensors[index], strict=True):
            assert torch.equal(mine, tensor) and torch.equal(theirs, tensor)
            assert mine.data_ptr() != tensor.data_ptr()  # a copy in the slab


class Failing(SlabBacking):
    """Refuses one block; records which threads added blocks."""

    def __init__(self, refuse: int) -> None:
        super().__init__(PageableMemory())
        self.refuse = refuse
        self.threads: set[str] = set()

    def add(self, layout: BlockLayout, tensors: Sequence[torch.Tensor]) -> None:
        self.threads.add(threading.current_thread().name)
        if layout.index == self.refuse:
            raise OSError("no memory for this block")
        super().add(layout, tensors)


def test_a_failing_block_stops_the_fill_with_its_error() -> None:
    model = build_flux()
    split = split_of(model)
    backing = Failing(refuse=split.plan.streamed[1])
    with pytest.raises(OSError, match="no memory for this block"):
        builders.fill(backing, split, workers=3)
    assert split.plan.streamed[1] not in backing._slabs
    assert any(name.startswith("dlo-fill") for name in backing.threads)
    backing.close()
