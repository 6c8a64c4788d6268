"""The steps ``enable_offload`` is composed of: split the model, open movement and storage,
fill, place on the device, attach.

Each step that changes something registers its undo on the caller's
``contextlib.ExitStack`` before (or as) it makes the change, so a failure anywhere unwinds
exactly what was done, newest first: placeholders swapped back, hooks removed, resident
tensors restored, staging freed, slabs unpinned, ranges unregistered, mappings closed.

Called only by ``backend.enable_offload``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch import nn

from ditserve.engine.config import OffloadConfig
from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.discovery import Discovery
from ditserve.engine.offload.hooks import BlockStreamer, StreamedBlock, make_streamed_block
from ditserve.engine.offload.host.backing import HostBacking
from ditserve.engine.offload.host.mapped import MappedBacking
from ditserve.engine.offload.host.memory import host_memory
from ditserve.engine.offload.host.shard_slabs import ShardBacking
from ditserve.engine.offload.host.slabs import SlabBacking
from ditserve.engine.offload.host.weight_plan import HostWeightPlan
from ditserve.engine.offload.movement.ce_gather import CopyEngineGather
from ditserve.engine.offload.movement.copy_stream import (
    CudaStreamTransfer,
    SyncTransfer,
    make_transfer,
)
from ditserve.engine.offload.movement.gather import GatherTransfer, StreamGather, SyncGather
from ditserve.engine.offload.movement.mapped import make_mapped_transfer
from ditserve.engine.offload.movement.transfer import Transfer
from ditserve.engine.offload.plan import GIB, OffloadPlan, SlotLayout, TensorSpec, build_plan
from ditserve.engine.offload.shards import shard_block, shard_slot_numel

# Device slots when offload.slots is unset. Rank-local streaming is copy-bound in every block,
# so two slots reach the PCIe floor. AllGather's shard copies are shorter than the single
# blocks' compute, so the copies need room to run ahead: on 2 x H200 (Flux, 1024^2, batch 1)
# eight slots measured 214-244 ms/step (median 220 over 21 runs) against 229-255 ms with two
# (docs/benchmarks.md), for 3.8 GiB more HBM.
DEFAULT_SLOTS = 2
DEFAULT_ALLGATHER_SLOTS = 8
BaseTransfer: TypeAlias = SyncTransfer | CudaStreamTransfer


@dataclass(frozen=True)
class ModelSplit:
    """The model cut into streamed blocks and resident tensors, and the plan for them."""

    blocks: tuple[tuple[str, nn.Module], ...]  # every block list entry, in call order
    block_tensors: list[list[torch.Tensor]]  # per block, in layout order
    resident_tensors: list[torch.Tensor]  # moved to the device once (resident blocks too)
    plan: OffloadPlan
    slots: int


def block_tensors(block: nn.Module) -> list[tuple[str, torch.Tensor]]:
    # Sorted by name: the order safetensors writes a block's tensors in (within one dtype),
    # so a block mapped from a checkpoint or cache entry lies in its slot exactly as in the
    # file and loads with one copy instead of one per tensor. Every layout (slabs, shards,
    # slots) and every pairing of tensors with views derives from this one order.
    return sorted(
        list(block.named_parameters()) + list(block.named_buffers()), key=lambda item: item[0]
    )


def check_tensors(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> None:
    """Every streamed tensor must be a plain dense tensor owned by exactly one block."""
    owners: dict[int, set[str]] = {}
    for name, block in blocks:
        for tname, t in block_tensors(block):
            if t.is_meta or t.layout != torch.strided or type(t.data) is not torch.Tensor:
                raise OffloadError(
                    f"{name}.{tname} is not a materialized dense tensor ({t.layout}, "
                    f"{type(t.data).__name__}, device {t.device}); load real weights first"
                )
            owners.setdefault(id(t), set()).add(name)
    for mname, module in model.named_modules():
        for _tname, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None and id(t) in owners and not any(
                mname == b or mname.startswith(b + ".") for b in owners[id(t)]
            ):
                owners[id(t)].add(mname or "<root>")
    shared = {k: v for k, v in owners.items() if len(v) > 1}
    if shared:
        names = sorted(next(iter(shared.values())))
        raise OffloadError(
            f"a tensor is shared by {', '.join(names)}; layerwise offload needs every block to "
            "own its weights - untie them before enabling offload"
        )


def slot_count(config: OffloadConfig, blocks: int, group_size: int) -> int:
    """``offload.slots``, or the mode's default; more slots than blocks would only hold
    copies of blocks already in a slot."""
    wanted = config.slots or (DEFAULT_ALLGATHER_SLOTS if group_size > 1 else DEFAULT_SLOTS)
    return min(wanted, max(blocks, 2))


def split_model(
    model: nn.Module,
    found: Discovery,
    config: OffloadConfig,
    *,
    group_size: int,
    slots: int,
    activation_reserve_bytes: int,
) -> ModelSplit:
    """Lay out every block (padded for ``group_size`` shards) and choose the resident ones."""
    per_block = [block_tensors(module) for _, module in found.blocks]
    tensors = [[t for _, t in named] for named in per_block]
    specs = [
        (name, [TensorSpec(tname, t.dtype, t.element_size(), tuple(t.shape)) for tname, t in named])
        for (name, _), named in zip(found.blocks, per_block, strict=True)
    ]
    in_blocks = {id(t) for ts in tensors for t in ts}
    resident = [t for t in list(model.parameters()) + list(model.buffers())
                if id(t) not in in_blocks]
    budget = config.hbm_budget_gib
    plan = build_plan(
        specs,
        resident_layers=config.resident_layers,
        hbm_budget_bytes=None if budget is None else int(budget * GIB),
        resident_module_bytes=sum(t.numel() * t.element_size() for t in resident),
        activation_reserve_bytes=activation_reserve_bytes,
        shard_multiple=group_size,
        slots=slots,
    )
    for index in plan.residency.resident:
        resident.extend(tensors[index])
    return ModelSplit(found.blocks, tensors, resident, plan, slots)


def open_transfer(device: torch.device, slots: int, undo: contextlib.ExitStack) -> BaseTransfer:
    """The device's copy path (raises if the device is unusable)."""
    transfer = make_transfer(device, slots)
    undo.callback(transfer.close)
    return transfer


def open_gather(
    base: BaseTransfer, group: Any, plan: OffloadPlan, engine: str, undo: contextlib.ExitStack
) -> GatherTransfer:
    """AllGather over ``group``: device shard slots sized to this rank's largest shard."""
    group_size = int(dist.get_world_size(group))
    try:
        rank = int(dist.get_rank(group))
        shards = [shard_block(plan.blocks[i], rank=rank, group_size=group_size)
                  for i in plan.streamed]
        sizes = shard_slot_numel(shards)
        gather: GatherTransfer
        if engine == "copy-engine":
            gather = CopyEngineGather(base, group, sizes)  # type: ignore[arg-type]  # checks CUDA
        elif isinstance(base, CudaStreamTransfer):
            gather = StreamGather(base, group, sizes)
        else:
            gather = SyncGather(base, group, sizes)
    except Exception as e:
        raise OffloadError(
            f"could not set up AllGather offload over a group of {group_size}: "
            f"{type(e).__name__}: {e}"
        ) from e
    undo.callback(gather.close)
    return gather


def open_backing(
    host_plan: HostWeightPlan | None,
    *,
    device: torch.device,
    gather: GatherTransfer | None,
    undo: contextlib.ExitStack,
) -> tuple[HostBacking, MappedBacking | None]:
    """The backing for the streamed blocks, and the same object when it is a mapped one
    (which then owns the plan; other plans are closed once the backing is filled)."""
    mapped: MappedBacking | None = None
    backing: HostBacking
    if gather is not None:
        backing = ShardBacking(host_memory(device), rank=gather.rank,
                               group_size=gather.group_size, rebuild=gather.gather_full)
    elif host_plan is not None and host_plan.mapped:
        mapped = backing = MappedBacking(host_plan)  # consumes the plan
    else:
        backing = SlabBacking(host_memory(device))
    undo.callback(backing.close)
    if host_plan is not None and mapped is None:
        if host_plan.mapped:
            host_plan.consume()  # AllGather: the shards are copied out of its mapping
        undo.callback(host_plan.close)
    return backing, mapped


def fill(backing: HostBacking, split: ModelSplit) -> None:
    for index in split.plan.streamed:
        backing.add(split.plan.blocks[index], split.block_tensors[index])


def allocate_slots(
    layout: SlotLayout, count: int, device: torch.device
) -> list[dict[Hashable, torch.Tensor]]:
    return [
        {
            dtype: torch.empty(numel, dtype=dtype, device=device)  # type: ignore[call-overload]
            for dtype, _, numel in layout.regions
        }
        for _ in range(count)
    ]


def move_to_device(
    tensors: Sequence[torch.Tensor], device: torch.device, undo: contextlib.ExitStack
) -> None:
    for t in tensors:
        undo.callback(_restore, t, t.data)
        t.data = t.data.to(device)


def open_mapped_transfer(
    base: BaseTransfer,
    backing: MappedBacking,
    split: ModelSplit,
    config: OffloadConfig,
    undo: contextlib.ExitStack,
) -> Transfer:
    """Registered or staged loads from the mapping. After the resident copies: a registered
    range is page-aligned, so a resident tensor may share its edge page, and a copy that starts
    inside a registered range but runs past its end is refused by the driver (invalid argument)."""
    transfer = make_mapped_transfer(base, backing, split.plan.slot,
                                    pin_limit_gib=config.pin_limit_gib,
                                    memory=host_memory(base.device))
    undo.callback(transfer.close)
    return transfer


def attach(
    model: nn.Module,
    split: ModelSplit,
    *,
    backing: HostBacking,
    transfer: Transfer,
    slots: Sequence[dict[Hashable, torch.Tensor]],
    strict: bool,
    undo: contextlib.ExitStack,
) -> BlockStreamer:
    """Prepare every streamed block's loads and views, then hook the blocks."""
    device = transfer.device
    bases = {
        dtype: torch.zeros((), dtype=dtype, device=device)  # type: ignore[call-overload]
        for dtype, _, _ in split.plan.slot.regions
    }
    streamed = [
        make_streamed_block(
            split.plan.blocks[index], split.blocks[index][1], split.block_tensors[index],
            slots=slots, host_regions=backing.regions(index), placeholder_bases=bases,
            prepare=transfer.prepare,
        )
        for index in split.plan.streamed
    ]
    streamer = BlockStreamer(streamed, transfer, strict=strict)
    undo.callback(streamer.detach)  # first: an attach that fails mid-way leaves hooks too
    streamer.attach(root=model)  # counts passes; completes them even when a forward raises
    return streamer


def swap_in_placeholders(blocks: Sequence[StreamedBlock], undo: contextlib.ExitStack) -> None:
    """Commit: the streamed blocks' original tensors are released."""
    for block in blocks:
        for t, ph in zip(block.tensors, block.placeholders, strict=True):
            undo.callback(_restore, t, t.data)
            t.data = ph


def _restore(tensor: torch.Tensor, data: torch.Tensor) -> None:
    tensor.data = data
