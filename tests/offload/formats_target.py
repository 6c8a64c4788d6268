"""Spawn target: one gloo rank streaming a toy bf16 DiT over an AllGather group in the host
weight formats - plain, lossless packed, and FP8.

Light on purpose (torch only, no diffusers). Every rank builds the same seeded model and
checks with ``torch.equal``: packed AllGather output equals plain AllGather output equals the
resident model (cold and warm steps); ``disable(gather=True)`` gives back the exact bf16
weights (stripes gathered, then decoded); after ``quantize_fp8`` the FP8 blocks (fp8 weights
and fp32 scales sharded and gathered as bytes) equal resident FP8. Report facts go to
``<out>/rank<r>.json``; a failed check raises, which ``torch.multiprocessing.spawn``
re-raises in the parent.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from distributed.rendezvous_support import join_group  # type: ignore[import-not-found]
from torch import nn

from ditserve.engine.config import OffloadConfig
from ditserve.engine.formats.fp8_select import FP8Rule, quantize_fp8
from ditserve.engine.offload import enable_offload


class Block(nn.Module):
    """bf16 linears (multiples of 16, so FP8 takes them) and an fp32 buffer (streams raw)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden, dtype=torch.bfloat16)
        self.down = nn.Linear(hidden, width, dtype=torch.bfloat16)
        self.register_buffer("scale", torch.rand(width) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.nn.functional.gelu(self.up(x)))
        return x + (y.float() * self.scale).to(x.dtype)


class ToyDiT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.embed = nn.Linear(16, 256, dtype=torch.bfloat16)
        # ~0.3-1M values per block: 8 stripes of whole 4096-value tiles pad them by ~5%.
        self.blocks = nn.ModuleList(Block(256, h) for h in (1024, 512, 2048))
        self.head = nn.Linear(256, 16, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _steps(model: nn.Module, x: torch.Tensor, config: OffloadConfig) -> tuple[list[torch.Tensor],
                                                                             dict]:
    handle = enable_offload(model, config, "cpu", group=dist.group.WORLD)
    try:
        with torch.no_grad():
            outs = [model(x) for _ in range(3)]
        report = handle.report()
    finally:
        handle.disable(gather=True)  # a collective: every rank together
    return outs, report


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    join_group("gloo", rank, world, port, timeout_s=120)
    try:
        model = ToyDiT()
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        with torch.no_grad():
            resident = model(x)
        plain, plain_report = _steps(model, x, OffloadConfig(enabled=True))
        packed, packed_report = _steps(model, x, OffloadConfig(enabled=True, compress="lossless"))
        assert all(torch.equal(o, resident) for o in plain + packed)
        after = model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in weights.items())  # exact, decoded back
        report = quantize_fp8(model, FP8Rule(block_lists=("blocks",)))
        with torch.no_grad():
            resident_fp8 = model(x)
        fp8, fp8_report = _steps(model, x, OffloadConfig(enabled=True))
        assert all(torch.equal(o, resident_fp8) for o in fp8)
        assert not torch.equal(resident_fp8, resident)  # it did quantize
        facts = {"plain": plain_report, "packed": packed_report, "fp8": fp8_report,
                 "fp8_layers": report.layers}
        Path(out, f"rank{rank}.json").write_text(json.dumps(facts))
    finally:
        dist.destroy_process_group()
