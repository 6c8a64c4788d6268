"""The model-side steps ``enable_offload`` is composed of: split the model, fill the host
backing, place on the device, attach the hooks (``pairing`` opens the backing and transfers).

Each step that changes something registers its undo on the caller's
``contextlib.ExitStack`` before (or as) it makes the change, so a failure anywhere unwinds
exactly what was done, newest first: placeholders swapped back, hooks removed, resident
tensors restored, staging freed, slabs unpinned, ranges unregistered, mappings closed.

Called only by ``backend.enable_offload``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ditserve.engine.config import OffloadConfig
from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.discovery import Discovery
from ditserve.engine.offload.hooks import (
    BlockStreamer,
    StreamedBlock,
    make_streamed_block,
    placeholder,
)
from ditserve.engine.offload.host.backing import HostBacking
from ditserve.engine.offload.movement.decode import DecodeInPlace
from ditserve.engine.offload.movement.slot_release import SlotRelease
from ditserve.engine.offload.movement.transfer import Transfer
from ditserve.engine.offload.plan import GIB, OffloadPlan, SlotLayout, TensorSpec, build_plan
from ditserve.engine.offload.slot_dequant import (
    STORED,
    BlockDequant,
    SlotDequant,
    slot_decoded_bytes,
)

# Device slots when offload.slots is unset. Rank-local streaming is copy-bound in every block,
# so two slots reach the PCIe floor. AllGather's shard copies are shorter than the single
# blocks' compute, so the copies need room to run ahead: on 2 x H200 (Flux, 1024^2, batch 1)
# eight slots measured 214-244 ms/step (median 220 over 21 runs) against 229-255 ms with two
# (docs/benchmarks.md), for 3.8 GiB more HBM.
DEFAULT_SLOTS = 2
DEFAULT_ALLGATHER_SLOTS = 8
# Threads filling plain slabs at enable (``fill``): enough to overlap page-locking with copies
# on a GPU host's cores without crowding the engine's other start work.
MAX_FILL_WORKERS = 8


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
    host_modules: Sequence[nn.Module] = (),
) -> ModelSplit:
    """Lay out every block (padded for ``group_size`` shards) and choose the resident ones.
    ``host_modules``' tensors are neither streamed nor resident: they stay where they are."""
    per_block = [block_tensors(module) for _, module in found.blocks]
    tensors = [[t for _, t in named] for named in per_block]
    specs = [
        (name, [TensorSpec(tname, t.dtype, t.element_size(), tuple(t.shape)) for tname, t in named])
        for (name, _), named in zip(found.blocks, per_block, strict=True)
    ]
    in_blocks = {id(t) for ts in tensors for t in ts}
    on_host = {id(t) for m in host_modules for t in (*m.parameters(), *m.buffers())}
    if in_blocks & on_host:
        raise OffloadError("a module kept in host memory lies inside a streamed block; keep "
                           "only modules outside the block lists on the host")
    resident = [t for t in list(model.parameters()) + list(model.buffers())
                if id(t) not in in_blocks and id(t) not in on_host]
    budget = config.hbm_budget_gib
    if isinstance(budget, str):  # "auto" is the engine planner's to resolve (budget_plan)
        raise OffloadError(
            f"offload.hbm_budget_gib={budget!r} reaches enable_offload unresolved; the engine "
            "resolves auto to the device's free HBM - pass a number of GiB here")
    plan = build_plan(
        specs,
        resident_layers=config.resident_layers,
        hbm_budget_bytes=None if budget is None else int(budget * GIB),
        resident_module_bytes=sum(t.numel() * t.element_size() for t in resident),
        activation_reserve_bytes=activation_reserve_bytes,
        shard_multiple=group_size,
        slots=slots,
        # --dlo-dequant slot: each slot also holds the largest block's decoded GGUF weights.
        slot_extra_bytes=slot_decoded_bytes(m for _, m in found.blocks)
        if config.dequant == "slot" else 0,
    )
    for index in plan.residency.resident:
        resident.extend(tensors[index])
    return ModelSplit(found.blocks, tensors, resident, plan, slots)


def fill_workers() -> int:
    """Threads that fill a backing which takes concurrent ``add``s (slabs)."""
    return max(1, min(MAX_FILL_WORKERS, os.cpu_count() or 1))


def fill(backing: HostBacking, split: ModelSplit, *, workers: int | None = None) -> None:
    """Copy every streamed block into the backing. A backing that declares
    ``concurrent_add`` (plain slabs: each block its own allocation) is filled by ``workers``
    threads: page-locking a block's fresh slab (``cudaHostRegister`` faults in and pins every
    page, in the kernel) and the copies release the GIL, so blocks overlap instead of paying
    each block's pinning and copying one after the other. Each thread works on the caller's
    CUDA device: registration is made in the current device's context."""
    blocks = [(split.plan.blocks[i], split.block_tensors[i]) for i in split.plan.streamed]
    workers = fill_workers() if workers is None else workers
    if workers <= 1 or len(blocks) <= 1 or not getattr(backing, "concurrent_add", False):
        for layout, tensors in blocks:
            backing.add(layout, tensors)
        return
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def add(block: tuple[Any, Sequence[torch.Tensor]]) -> None:
        if device is not None:
            torch.cuda.set_device(device)
        backing.add(*block)

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dlo-fill")
    try:
        for _ in pool.map(add, blocks):  # in order; the first failure is raised here
            pass
    finally:
        # After a failure the blocks not started are dropped; the caller's undo releases
        # the slabs that were added.
        pool.shutdown(wait=True, cancel_futures=True)


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


def attach(
    model: nn.Module,
    split: ModelSplit,
    *,
    backing: HostBacking,
    transfer: Transfer,
    slots: Sequence[dict[Hashable, torch.Tensor]],
    strict: bool,
    undo: contextlib.ExitStack,
    dequant: SlotDequant | None = None,
    slot_release: SlotRelease | None = None,
) -> BlockStreamer:
    """Prepare every streamed block's loads and views, then hook the blocks. ``dequant``:
    the blocks' GGUF layers decode into the slots' decoded regions (``slot_dequant``);
    ``slot_release``: the slots go back between passes, which also end with the forward of
    the module holding every block list (``pass_scope``)."""
    device = transfer.device
    bases = {
        dtype: torch.zeros((), dtype=dtype, device=device)  # type: ignore[call-overload]
        for dtype, _, _ in split.plan.slot.regions
    }
    decoding = dequant.blocks if dequant is not None else [None] * len(split.plan.streamed)
    regions = dequant.regions if dequant is not None else []
    streamed = []
    for index, block_dq in zip(split.plan.streamed, decoding, strict=True):
        hosts = backing.regions(index)
        if block_dq is not None:
            hosts = dict(hosts)
            hosts[STORED] = DecodeInPlace(hosts[STORED], block_dq.codec, tuple(
                region[: block_dq.codec.numel] for region in regions))
        block = make_streamed_block(
            split.plan.blocks[index], split.blocks[index][1], split.block_tensors[index],
            slots=slots, host_regions=hosts, placeholder_bases=bases,
            prepare=transfer.prepare,
        )
        if block_dq is not None:
            _derive(block, block_dq, regions, undo)
        streamed.append(block)
    streamer = BlockStreamer(streamed, transfer, strict=strict, slot_release=slot_release)
    undo.callback(streamer.detach)  # first: an attach that fails mid-way leaves hooks too
    # Counts passes; completes them even when a forward raises.
    if slot_release is None:
        streamer.attach(root=model)
    else:
        streamer.attach(root=model, scope=pass_scope(model, split.blocks))
    return streamer


def pass_scope(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> nn.Module:
    """The innermost module whose forward runs every block list: the common owner of the
    lists (``model.language_model.layers`` and ``model.vision_tower.transformer.layers``:
    ``model``). A pipeline may call it rather than ``model`` (FLUX.2 and Qwen-Image call their
    encoder's ``.model``: its LM head stays unused), and its end is then a pass's end."""
    owners = {name.rsplit(".", 1)[0].rpartition(".")[0] for name, _ in blocks}
    parts = [owner.split(".") if owner else [] for owner in owners]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return model.get_submodule(".".join(common)) if common else model


def _derive(block: StreamedBlock, dq: BlockDequant, regions: Sequence[torch.Tensor],
            undo: contextlib.ExitStack) -> None:
    """Give each GGUF layer of ``block`` a ``decoded_weight``: a placeholder between its
    forwards, a view of the slot's decoded region while it runs."""
    base = torch.zeros((), dtype=dq.codec.dtype, device=regions[0].device)
    views: list[list[torch.Tensor]] = [[] for _ in regions]
    for layer, run in dq.layers:
        shape = (run.rows, run.cols)
        tensor = torch.empty(0, dtype=dq.codec.dtype, device=base.device)
        tensor.data = placeholder(base, shape)
        undo.callback(setattr, layer, "decoded_weight", None)
        layer.decoded_weight = tensor
        block.derived.append(tensor)
        block.derived_placeholders.append(placeholder(base, shape))
        for s, region in enumerate(regions):
            views[s].append(region[run.out_offset : run.out_offset + run.numel].view(shape))
    block.derived_views = views


def swap_in_placeholders(blocks: Sequence[StreamedBlock], undo: contextlib.ExitStack) -> None:
    """Commit: the streamed blocks' original tensors are released."""
    for block in blocks:
        for t, ph in zip(block.tensors, block.placeholders, strict=True):
            undo.callback(_restore, t, t.data)
            t.data = ph


def _restore(tensor: torch.Tensor, data: torch.Tensor) -> None:
    tensor.data = data
