"""Released encoder slots on CUDA (run on the device machine): after a pass the allocated HBM
drops by the slots' bytes, the memory they gave back is reused in between, and the outputs
equal a resident run's and a run that keeps its slots, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ditserve.engine.config import OffloadConfig
from ditserve.engine.offload import enable_offload

pytestmark = pytest.mark.gpu
DLO = OffloadConfig(enabled=True)
WIDTH, LAYERS = 1024, 8  # bf16 layers of 2 MiB: slots far above the allocator's rounding


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return h


class Headed(nn.Module):
    """An encoder its pipeline calls through ``.model``, never its head (FLUX.2's Mistral3)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.model = Inner()
        self.lm_head = nn.Linear(WIDTH, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(ids))


def _encode(encoder: Headed, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out = encoder.model(ids).cpu()  # a sync: the pass's work is done
    return out


def test_released_slots_free_their_hbm_between_passes_and_outputs_stay_identical() -> None:
    ids = torch.randint(0, 64, (4, 77), generator=torch.Generator().manual_seed(2)).cuda()
    reference = Headed().to(torch.bfloat16).cuda()  # seeded: the offloaded runs' weights
    expected = _encode(reference, ids)
    del reference
    held_after: dict[bool, int] = {}
    for release in (False, True):
        encoder = Headed().to(torch.bfloat16).eval()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        handle = enable_offload(encoder, DLO, device="cuda", release_slots=release)
        during: list[int] = []
        encoder.model.layers[LAYERS // 2].register_forward_hook(
            lambda *_, during=during: during.append(torch.cuda.memory_allocated()))
        try:
            report = handle.report()
            slot_total = report["slots"] * report["slot_bytes"]
            assert slot_total >= 2 * WIDTH * WIDTH * 2
            for _ in range(3):
                assert torch.equal(_encode(encoder, ids), expected)
                between = torch.cuda.memory_allocated()
                assert handle.report()["slots_allocated"] is not release
                if release:
                    # The pass held its slots; their bytes went back when it ended.
                    assert during[-1] - between >= slot_total
                    # The freed memory is the allocator's to reuse before the next pass
                    # (the restored slots' first copies wait for this work).
                    scratch = torch.full((slot_total // 2,), 7, dtype=torch.bfloat16,
                                         device="cuda")
                    del scratch
            held_after[release] = torch.cuda.memory_allocated() - before
        finally:
            handle.disable()
            del encoder
    # What differs between keeping and releasing the slots is exactly the slots (allocator
    # blocks round each buffer up to 512 bytes).
    assert abs(held_after[False] - held_after[True] - slot_total) <= 4 * 512
