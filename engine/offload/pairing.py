"""Which host backing a DLO holds its blocks in, and which transfer moves them: opened once,
together, by ``backend.enable_offload``.

Pairings: plain slabs with the copy stream; AllGather shards with a gather around it; a
mapping with a direct (registered) or staged transfer; packed slabs (``compress`` lossless,
whole or this rank's stripes) with a decoding transfer around the copy stream or the gather.
Each opener registers its undo (close) on the caller's ``contextlib.ExitStack``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Hashable, Mapping
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

from ditserve.engine.config import OffloadConfig
from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.host.backing import HostBacking
from ditserve.engine.offload.host.mapped import MappedBacking
from ditserve.engine.offload.host.memory import host_memory
from ditserve.engine.offload.host.packed_slabs import PackedBacking
from ditserve.engine.offload.host.shard_slabs import ShardBacking
from ditserve.engine.offload.host.slabs import SlabBacking
from ditserve.engine.offload.host.weight_plan import HostWeightPlan
from ditserve.engine.offload.movement.ce_gather import CopyEngineGather
from ditserve.engine.offload.movement.copy_stream import (
    CudaStreamTransfer,
    SyncTransfer,
    make_transfer,
)
from ditserve.engine.offload.movement.decode import DecodingTransfer, copy_source, largest_run
from ditserve.engine.offload.movement.gather import (
    GatherTransfer,
    StreamGather,
    SyncGather,
    gather_full,
)
from ditserve.engine.offload.movement.mapped import make_mapped_transfer
from ditserve.engine.offload.movement.transfer import Transfer
from ditserve.engine.offload.plan import OffloadPlan

BaseTransfer: TypeAlias = SyncTransfer | CudaStreamTransfer


def open_transfer(device: torch.device, slots: int, undo: contextlib.ExitStack) -> BaseTransfer:
    """The device's copy path (raises if the device is unusable)."""
    transfer = make_transfer(device, slots)
    undo.callback(transfer.close)
    return transfer


def open_gather(
    base: BaseTransfer,
    group: Any,
    shard_slot: Mapping[Hashable, tuple[int, int]],
    engine: str,
    undo: contextlib.ExitStack,
) -> GatherTransfer:
    """AllGather over ``group``, with device shard slots of ``shard_slot`` (per dtype:
    itemsize, numel) - this rank's largest shard (``shard_slot_sizes``)."""
    group_size = int(dist.get_world_size(group))
    try:
        gather: GatherTransfer
        if engine == "copy-engine":
            gather = CopyEngineGather(base, group, shard_slot)  # type: ignore[arg-type]  # checks CUDA
        elif isinstance(base, CudaStreamTransfer):
            gather = StreamGather(base, group, shard_slot)
        else:
            gather = SyncGather(base, group, shard_slot)
    except Exception as e:
        raise OffloadError(
            f"could not set up AllGather offload over a group of {group_size}: "
            f"{type(e).__name__}: {e}"
        ) from e
    undo.callback(gather.close)
    return gather


def shard_slot_sizes(backing: HostBacking, plan: OffloadPlan) -> dict[Hashable, tuple[int, int]]:
    """Per dtype, (itemsize, numel) of the largest host source a load copies (this rank's
    shards; a packed region's stripes as uint8): the size of one device shard slot."""
    sizes: dict[Hashable, tuple[int, int]] = {}
    for index in plan.streamed:
        for source in backing.regions(index).values():
            t = copy_source(source)
            _, numel = sizes.get(t.dtype, (t.element_size(), 0))
            sizes[t.dtype] = (t.element_size(), max(numel, t.numel()))
    return sizes


def open_backing(
    host_plan: HostWeightPlan | None,
    config: OffloadConfig,
    *,
    device: torch.device,
    group: Any,
    group_size: int,
    undo: contextlib.ExitStack,
) -> tuple[HostBacking, MappedBacking | None]:
    """The backing for the streamed blocks, and the same object when it is a mapped one
    (which then owns the plan; other plans are closed once the backing is filled).

    Packed (``compress`` lossless, whole or this rank's stripes) and AllGather shards copy out
    of whatever the tensors are, a mapping included; only rank-local plain streaming reads a
    mapped plan in place."""
    mapped: MappedBacking | None = None
    backing: HostBacking
    rank = int(dist.get_rank(group)) if group_size > 1 else 0
    # The full blocks, from every rank's parts, at disable (a collective).
    rebuild = (functools.partial(gather_full, group=group, device=device)
               if group_size > 1 else None)
    if config.compress == "lossless":
        backing = PackedBacking(host_memory(device), encode_device=device, rank=rank,
                                group_size=group_size, rebuild=rebuild)
    elif group_size > 1:
        backing = ShardBacking(host_memory(device), rank=rank, group_size=group_size,
                               rebuild=rebuild)  # type: ignore[arg-type]
    elif host_plan is not None and host_plan.mapped:
        mapped = backing = MappedBacking(host_plan)  # consumes the plan
    else:
        backing = SlabBacking(host_memory(device))
    undo.callback(backing.close)
    if host_plan is not None and mapped is None:
        if host_plan.mapped:
            host_plan.consume()  # copied out of its mapping (shards, packed slabs)
        undo.callback(host_plan.close)
    return backing, mapped


def open_mapped_transfer(
    base: BaseTransfer,
    backing: MappedBacking,
    plan: OffloadPlan,
    config: OffloadConfig,
    undo: contextlib.ExitStack,
) -> Transfer:
    """Registered or staged loads from the mapping. After the resident copies: a registered
    range is page-aligned, so a resident tensor may share its edge page, and a copy that starts
    inside a registered range but runs past its end is refused by the driver (invalid argument)."""
    transfer = make_mapped_transfer(base, backing, plan.slot,
                                    pin_limit_gib=config.pin_limit_gib,
                                    memory=host_memory(base.device))
    undo.callback(transfer.close)
    return transfer


def open_decoding(
    transfer: Transfer,
    backing: HostBacking,
    plan: OffloadPlan,
    slots: int,
    undo: contextlib.ExitStack,
    *,
    in_place: bool = False,
) -> Transfer:
    """Packed regions: copy (or gather) into per-slot device staging, decode into the slot.
    ``in_place``: GGUF layers (``--dlo-dequant slot``), decoded from the slot itself (no
    staging; the hooks' prepared loads carry the codecs)."""
    largest = largest_run(source for index in plan.streamed
                          for source in backing.regions(index).values())
    if largest == 0 and not in_place:
        raise OffloadError(
            "--dlo-compress lossless packs bfloat16 weights, but the streamed blocks hold none "
            "(dtypes: " + ", ".join(sorted({str(r.dtype) for b in plan.streamed_blocks
                                           for r in b.regions})) + "); load the DiT in "
            "bfloat16 (--dtype bfloat16) or drop --dlo-compress")
    decoding = DecodingTransfer(transfer, slots=slots, staging_bytes=largest)
    undo.callback(decoding.close)
    return decoding
