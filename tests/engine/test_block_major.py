"""BlockMajor: forwards in lockstep at block barriers, and the offload hooks under repeats.

Toy models on the CPU: the order blocks run in, lanes that skip blocks, a lane that fails,
an interrupt, and (with a recording transfer) that a strict (AllGather) streamer issues the
same loads in one pass whether a step has one shape group or three.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ditserve.engine.offload.hooks import BlockStreamer, StreamedBlock
from ditserve.engine.runner.block_major import BlockMajor


class Toy(nn.Module):
    """Two block lists run in order; ``start`` skips the blocks before it (an expert that
    only some groups need); an input of ``fail_rows`` rows raises after block 2."""

    def __init__(self, first: int = 3, second: int = 2) -> None:
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(4, 4) for _ in range(first))
        self.b = nn.ModuleList(nn.Linear(4, 4) for _ in range(second))
        self.calls: list[tuple[int, int]] = []  # (block position, rows)
        self.fail_rows: int | None = None
        for position, block in enumerate([*self.a, *self.b]):
            block.register_forward_pre_hook(self._record(position))

    def _record(self, position: int) -> Any:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            self.calls.append((position, args[0].shape[0]))

        return hook

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        for position, block in enumerate([*self.a, *self.b]):
            if position >= start:
                x = torch.tanh(block(x))
            if position == 2 and x.shape[0] == self.fail_rows:  # after block 2 ran
                raise RuntimeError("this group fails between blocks")
        return x


@pytest.fixture
def toy() -> Toy:
    torch.manual_seed(0)
    return Toy()


def test_every_lane_runs_a_block_before_any_lane_runs_the_next(toy: Toy) -> None:
    major = BlockMajor(toy, ["a", "b"])
    inputs = [torch.randn(rows, 4) for rows in (1, 2, 3)]
    alone = [toy(x) for x in inputs]
    toy.calls.clear()
    outcomes = major.run([lambda x=x: toy(x) for x in inputs])
    for outcome, want in zip(outcomes, alone, strict=True):
        assert outcome.error is None and torch.equal(outcome.value, want)
    assert toy.calls == [(p, rows) for p in range(5) for rows in (1, 2, 3)]


def test_a_lane_that_skips_blocks_joins_at_its_first_block(toy: Toy) -> None:
    major = BlockMajor(toy, ["a", "b"])
    late, early = torch.randn(2, 4), torch.randn(1, 4)
    outcomes = major.run([lambda: toy(late, start=3), lambda: toy(early)])
    assert torch.equal(outcomes[0].value, toy(late, start=3))
    assert toy.calls[:6] == [(0, 1), (1, 1), (2, 1), (3, 2), (3, 1), (4, 2)]


def test_a_failing_lane_fails_alone(toy: Toy) -> None:
    major = BlockMajor(toy, ["a", "b"])
    inputs = [torch.randn(rows, 4) for rows in (1, 3, 2)]
    toy.fail_rows = 3
    outcomes = major.run([lambda x=x: toy(x) for x in inputs])
    assert isinstance(outcomes[1].error, RuntimeError) and outcomes[1].value is None
    toy.fail_rows = None
    for i in (0, 2):
        assert torch.equal(outcomes[i].value, toy(inputs[i]))


def test_an_interrupt_unwinds_every_lane_and_leaves_the_hooks_inert(toy: Toy) -> None:
    major = BlockMajor(toy, ["a", "b"])
    unwound: list[int] = []

    def forward(i: int) -> torch.Tensor:
        try:
            if i == 1:
                toy.a[0](torch.randn(1, 4))
                raise KeyboardInterrupt
            return toy(torch.randn(1, 4))
        finally:
            unwound.append(i)

    with pytest.raises(KeyboardInterrupt):
        major.run([lambda i=i: forward(i) for i in range(3)])
    assert sorted(unwound) == [0, 1, 2]
    x = torch.randn(2, 4)
    assert toy(x).shape == (2, 4)  # outside run() the barrier never suspends
    assert [o.value.shape for o in major.run([lambda: toy(x)])] == [(2, 4)]
    major.close()


def test_not_a_block_list_is_refused(toy: Toy) -> None:
    with pytest.raises(TypeError, match="not a block list"):
        BlockMajor(toy, ["a.0"])


class RecordingTransfer:
    """A transfer that only records what the hooks ask of it."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.loads: list[tuple[int, int]] = []

    def load(self, prepared: Any, slot: int) -> None:
        self.loads.append((prepared, slot))

    def wait_ready(self, slot: int) -> None:
        pass

    def release(self, slot: int) -> None:
        pass


def strict_streamer(model: Toy, slots: int = 2) -> tuple[BlockStreamer, RecordingTransfer]:
    transfer = RecordingTransfer()
    blocks = [StreamedBlock(name=f"block{k}", module=module, tensors=[], views=[[]] * slots,
                            copies=[k] * slots, placeholders=[], nbytes=10)
              for k, module in enumerate([*model.a, *model.b])]
    streamer = BlockStreamer(blocks, transfer, strict=True)  # type: ignore[arg-type]
    streamer.attach(root=model)
    return streamer, transfer


@pytest.mark.parametrize("slots", [2, 3])
def test_a_strict_streamer_loads_the_same_in_one_pass_for_one_group_or_three(slots: int) -> None:
    # AllGather: every load is a collective, so ranks must issue the same loads whatever
    # their shape groups. Repeats of a block load nothing, and a step is one pass.
    torch.manual_seed(0)
    one, three = Toy(), Toy()
    three.load_state_dict(one.state_dict())
    s1, t1 = strict_streamer(one, slots)
    s3, t3 = strict_streamer(three, slots)
    major = BlockMajor(three, ["a", "b"])
    for step in range(3):
        with s1.one_pass():
            one(torch.randn(2, 4))
        inputs = [torch.randn(rows, 4) for rows in (1, 2, 3)]
        three.fail_rows = 3 if step == 1 else None  # a group failing mid-pass changes nothing
        with s3.one_pass():
            outcomes = major.run([lambda x=x: three(x) for x in inputs])
        assert [o.error is None for o in outcomes] == [True, True, step != 1]
        assert t3.loads == t1.loads and s3.passes == s1.passes == step + 1
    assert s3.bytes_transferred == s1.bytes_transferred


def test_a_strict_pass_with_no_block_run_is_left_to_the_idle_pass() -> None:
    streamer, transfer = strict_streamer(Toy())
    with streamer.one_pass():
        pass
    assert streamer.passes == 0 and transfer.loads == []
    streamer.idle_pass()
    # Every block once, and block 0 again into the free slot: the next step starts warm.
    assert streamer.passes == 1 and [k for k, _ in transfer.loads] == [0, 1, 2, 3, 4, 0]
