"""Spawn target for the AllGather unit tests: one gloo rank offloading a toy DiT over a group.

Light on purpose (torch only, no diffusers): each spawned process imports this module. Every
rank builds the same seeded model, keeps a copy of its block tensors, enables AllGather offload
over the world group and checks, with ``torch.equal``:

- every block's tensors, as pointed into the slot at the moment the block runs, equal the
  original full tensors (the shard H2D + all_gather path rebuilds them bit for bit);
- forwards equal the resident model's output, cold and warm;
- uneven loads: while one rank runs forwards, the others run idle passes (each rank in turn,
  with different inputs), and everyone's outputs stay exact;
- a forward that raises inside a block on one rank still completes its pass, and the next
  forwards on every rank are exact (no deadlock);
- ``disable(gather=True)`` (a collective) gives back the full tensors, bit-identical.

Facts the parent checks (report figures) are written to ``<out>/rank<r>.json``. Any failed
check raises, which ``torch.multiprocessing.spawn`` re-raises in the parent.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from distributed.rendezvous_support import join_group  # type: ignore[import-not-found]
from torch import nn

from ditserve.engine.config import OffloadConfig
from ditserve.engine.offload import enable_offload


class Block(nn.Module):
    """A residual block; widths, dtypes (float32 and float64) and buffers vary per block."""

    def __init__(self, width: int, hidden: int, wide_gate: bool) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width, bias=False)
        self.gate = nn.Parameter(torch.randn(width, dtype=torch.float64 if wide_gate else torch.float32))
        self.register_buffer("shift", torch.randn(width))
        # Interleaved dtypes in registration order (float64, float32..., float64).
        self.register_buffer("scale", torch.rand(width, dtype=torch.float64) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x))) * self.gate.to(x.dtype) + self.shift
        return x + y * self.scale.to(x.dtype)


class ToyDiT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Linear(8, 16)
        # Odd count, very different sizes: per-block gathers of different lengths.
        self.blocks = nn.ModuleList(
            Block(16, h, wide_gate=i % 2 == 1) for i, h in enumerate([64, 8, 200, 16, 40])
        )
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _inputs(seed: int, device: torch.device) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(seed)).to(device)


class BlockFault(Exception):
    """Raised on purpose inside a block."""


def run_rank(rank: int, world: int, port: int, out: str, backend: str = "gloo",
             slots: int | None = None, gather: str = "nccl") -> None:
    """One rank: gloo on the CPU, or NCCL on cuda:rank (the gpu-marked test)."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    join_group(backend, rank, world, port, timeout_s=60)
    try:
        _checks(rank, world, Path(out), device, OffloadConfig(enabled=True, slots=slots,
                                                              gather=gather))
    finally:
        dist.destroy_process_group()


def _checks(rank: int, world: int, out: Path, device: torch.device, config: OffloadConfig) -> None:
    model = ToyDiT().eval().to(device)
    originals = {name: t.detach().clone() for name, t in model.blocks.state_dict().items()}
    with torch.inference_mode():
        expected = {seed: model(_inputs(seed, device)) for seed in range(world + 1)}

    handle = enable_offload(model, config, device=device,
                            group=dist.group.WORLD)
    report = handle.report()
    assert handle.needs_collective_participation
    expected_transfer = "h2d+p2p-copy" if config.gather == "copy-engine" else "h2d+allgather"
    assert report["transfer"] == expected_transfer and report["group_size"] == world
    # AllGather picks 8 slots when unset, never more than there are blocks.
    assert report["slots"] == min(config.slots or 8, len(model.blocks))

    seen: dict[str, bool] = {}

    def probe(name: str):  # runs after the offload pre-hook has pointed the block at its slot
        def hook(module: nn.Module, args: tuple) -> None:
            for tname, t in module.state_dict().items():
                seen[f"{name}.{tname}"] = torch.equal(t, originals[f"{name}.{tname}"])
        return hook

    probes = [b.register_forward_pre_hook(probe(str(i))) for i, b in enumerate(model.blocks)]

    def forward(seed: int) -> None:
        with torch.inference_mode():
            got = model(_inputs(seed, device))
        assert torch.equal(got, expected[seed]), f"rank {rank}: forward {seed} differs"

    forward(0)  # cold: the first blocks load on a miss
    forward(0)  # warm: block 0 was prefetched at the end of the last pass
    assert seen and all(seen.values()), f"rank {rank}: gathered tensors differ: {seen}"
    for p in probes:
        p.remove()

    # Uneven loads: rank r runs forward r while the others only join its gathers.
    for turn in range(world):
        for _ in range(turn + 1):  # different numbers of steps per turn
            if rank == turn:
                forward(turn + 1)
            else:
                handle.idle_pass()

    # A fault inside block 2 on rank 0 (others run forwards normally in the same pass).
    fault = model.blocks[2].register_forward_pre_hook(
        lambda m, a: (_ for _ in ()).throw(BlockFault("injected")) if rank == 0 else None)
    try:
        forward(0)
        assert rank != 0, "the injected fault did not fire"
    except BlockFault:
        assert rank == 0
    fault.remove()
    forward(1)
    forward(0)

    passes = handle.passes
    final = handle.report()
    handle.disable(gather=True)  # collective: every rank rebuilds the full blocks
    restored = {name: t for name, t in model.blocks.state_dict().items()}
    for name, t in originals.items():
        assert torch.equal(restored[name].to(device), t), f"rank {rank}: {name} not restored"
    model.to(device)
    forward(0)  # the model runs again on its restored tensors

    (out / f"rank{rank}.json").write_text(json.dumps({
        "report": report, "final": final, "passes": passes,
        "model_block_bytes": sum(t.numel() * t.element_size() for t in originals.values()),
    }))
