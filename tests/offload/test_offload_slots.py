"""More than two device slots: copies run ahead of compute, and the output does not change."""

from __future__ import annotations

import argparse

import pytest
import torch
from offload.test_offload_generic import ToyDiT  # type: ignore[import-not-found]

from ditserve.engine.config import OffloadConfig, offload_problems
from ditserve.engine.config.flags import add_engine_options, engine_config_from_args
from ditserve.engine.offload import enable_offload
from ditserve.engine.offload.hooks import BlockStreamer, StreamedBlock


@pytest.mark.parametrize("slots", [2, 3, 4, 5, 8])
def test_any_slot_count_equals_resident(slots: int) -> None:
    model = ToyDiT().eval()  # five blocks of very different sizes
    x = torch.randn(3, 8)
    with torch.inference_mode():
        expected = model(x)
    handle = enable_offload(model, OffloadConfig(enabled=True, slots=slots), device="cpu")
    try:
        for _ in range(3):
            with torch.inference_mode():
                assert torch.equal(model(x), expected)
        report = handle.report()
        assert report["slots"] == min(slots, 5)  # never more slots than blocks
        if slots >= 5:  # every block has its own slot: nothing moves after the first pass
            assert report["block_loads"] == 5
        else:  # three passes, plus the next pass's first slots-1 blocks, already prefetched
            assert report["block_loads"] == 3 * 5 + slots - 1
        assert report["load_misses"] == 1
    finally:
        handle.disable()


class RecordingTransfer:
    """Records (block, slot) per load and checks no slot is overwritten while in use."""

    def __init__(self) -> None:
        self.loads: list[tuple[int, int]] = []
        self.in_use: set[int] = set()

    def load(self, pairs, slot: int) -> None:  # type: ignore[no-untyped-def]
        assert slot not in self.in_use, f"slot {slot} overwritten while its block runs"
        self.loads.append((pairs[0][0], slot))

    def wait_ready(self, slot: int) -> None:
        self.in_use.add(slot)

    def release(self, slot: int) -> None:
        self.in_use.discard(slot)


def streamer(blocks: int, slots: int) -> tuple[BlockStreamer, RecordingTransfer]:
    fake = [
        StreamedBlock(name=f"b{k}", module=torch.nn.Identity(), tensors=[],
                      views=[[] for _ in range(slots)],
                      copies=[[(k, None)] for _ in range(slots)],  # type: ignore[list-item]
                      placeholders=[], nbytes=1)
        for k in range(blocks)
    ]
    transfer = RecordingTransfer()
    return BlockStreamer(fake, transfer), transfer


@pytest.mark.parametrize(("blocks", "slots"), [(7, 2), (7, 3), (9, 4), (57, 8)])
def test_copies_run_slots_minus_one_blocks_ahead(blocks: int, slots: int) -> None:
    s, transfer = streamer(blocks, slots)
    for _ in range(3):
        for k in range(blocks):
            s.before_block(k)
            # Block k and the next slots-1 blocks are in slots before k computes.
            assert {(k + j) % blocks for j in range(slots)} <= set(s.loaded)
            s.after_block(k)
    # Every load after the cold start reuses the slot of the block that ran just before:
    # the copy of block k+slots-1 waits only for block k-1's compute.
    warm = transfer.loads[slots:]
    assert [b for b, _ in warm] == [(slots + i) % blocks for i in range(len(warm))]
    slot_of: dict[int, int] = dict(transfer.loads[:slots])
    for block, slot in warm:
        previous = (block - slots) % blocks
        assert slot == slot_of[previous]
        slot_of[block] = slot
    assert s.misses == 1
    assert len(transfer.loads) == 3 * blocks + slots - 1


def test_out_of_order_calls_with_many_slots_stay_safe() -> None:
    s, transfer = streamer(6, 4)
    for k in (0, 1, 4, 2, 2, 5, 0, 3, 1):
        s.before_block(k)
        s.after_block(k)
    assert len(set(s.loaded)) == 4


def test_fewer_than_two_slots_is_refused_with_the_fix() -> None:
    assert offload_problems(OffloadConfig(enabled=True)) == []  # unset: picked per mode
    problems = offload_problems(OffloadConfig(enabled=True, slots=1))
    assert problems == ["offload.slots must be an integer >= 2, got 1"]
    problems = offload_problems(OffloadConfig(enabled=False, slots=4))
    assert any("offload.slots only apply with offload enabled" in p for p in problems)


def test_cli_flag_sets_the_slot_count() -> None:
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(["--offload", "dlo", "--dlo-slots", "6"])
    assert engine_config_from_args(args).offload.slots == 6


def test_unknown_gather_engine_is_refused() -> None:
    problems = offload_problems(OffloadConfig(enabled=True, gather="mpi"))
    assert problems == ["offload.gather must be one of nccl, copy-engine, got 'mpi'"]


def test_copy_engine_gather_needs_cuda() -> None:
    from ditserve.engine.errors import OffloadError
    from ditserve.engine.offload.movement.ce_gather import CopyEngineGather
    from ditserve.engine.offload.movement.copy_stream import SyncTransfer

    with pytest.raises(OffloadError, match="needs CUDA devices; use 'nccl'"):
        CopyEngineGather(SyncTransfer(torch.device("cpu")), None, {})  # type: ignore[arg-type]
