"""Enable and disable layerwise offload (DLO) on one device: the package's entry point.

``enable_offload`` turns a diffusers DiT into a streamed model, all or nothing: discover the
block lists, plan layouts and residency, fill one host slab per streamed block, allocate the
device slots (``offload.slots``; by default two, or eight with AllGather), move resident
modules to the device, attach the hooks, and only then swap the streamed blocks' tensors for
placeholders. Any failure undoes every step and raises
``OffloadError``; the model is left as it was.

The returned ``OffloadHandle`` (``handle``) reports what is streamed and undoes it.

With ``group=`` a process group of size > 1 (AllGather mode), each rank keeps only its
1/group shard of every streamed block (``shard_storage``) and loads rebuild blocks with
``all_gather_into_tensor`` (``gather``); every rank of the group must then run the same passes
(forwards or ``OffloadHandle.idle_pass``), see ``hooks``.

Called by the engine's model runner (``--offload dlo``) and by ``bench/offload.py`` /
``bench/offload_dp.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ditserve.engine.config import OffloadConfig, offload_problems
from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.ce_gather import CopyEngineGather
from ditserve.engine.offload.discovery import discover
from ditserve.engine.offload.gather import GatherTransfer
from ditserve.engine.offload.handle import _ACTIVE, OffloadHandle
from ditserve.engine.offload.hooks import BlockStreamer, make_streamed_block
from ditserve.engine.offload.host import HostStorage
from ditserve.engine.offload.host_plan import HostWeightPlan
from ditserve.engine.offload.mapped_storage import MappedStorage
from ditserve.engine.offload.plan import GIB, TensorSpec, build_plan
from ditserve.engine.offload.shard_storage import ShardStorage
from ditserve.engine.offload.shards import shard_block, shard_slot_numel
from ditserve.engine.offload.staging import MappedTransfer, make_mapped_transfer
from ditserve.engine.offload.transfer import make_transfer

log = logging.getLogger(__name__)

# HBM kept free for activations when residency comes from --dlo-hbm-budget-gib; callers that
# know their batch and resolution pass ``activation_reserve_bytes`` instead.
DEFAULT_ACTIVATION_RESERVE_BYTES = 2 * GIB
# Device slots when offload.slots is unset. Rank-local streaming is copy-bound in every block,
# so two slots reach the PCIe floor. AllGather's shard copies are shorter than the single
# blocks' compute, so the copies need room to run ahead: on 2 x H200 (Flux, 1024^2, batch 1)
# eight slots measured 214-244 ms/step (median 220 over 21 runs) against 229-255 ms with two
# (docs/benchmarks.md), for 3.8 GiB more HBM.
DEFAULT_SLOTS = 2
DEFAULT_ALLGATHER_SLOTS = 8


def _block_tensors(block: nn.Module) -> list[tuple[str, torch.Tensor]]:
    # Sorted by name: the order safetensors writes a block's tensors in (within one dtype),
    # so a block mapped from a checkpoint or cache entry lies in its slot exactly as in the
    # file and loads with one copy instead of one per tensor. Every layout (slabs, shards,
    # slots) and every pairing of tensors with views derives from this one order.
    return sorted(
        list(block.named_parameters()) + list(block.named_buffers()), key=lambda item: item[0]
    )


def _check_config(config: OffloadConfig, host_plan: HostWeightPlan | None) -> None:
    found = offload_problems(config)
    if not config.enabled:
        found.insert(0, "offload.enabled is false; set it (--offload dlo) to enable offload")
    if host_plan is None and (config.runtime_cache or config.pin_limit_gib):
        found.append(
            "offload.runtime_cache / offload.pin_limit_gib act on the loader's HostWeightPlan; "
            "pass host_plan= (ModelRunner does) or unset them"
        )
    if found:
        raise OffloadError("cannot enable offload:\n  - " + "\n  - ".join(found))


def _check_tensors(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> None:
    """Every streamed tensor must be a plain dense tensor owned by exactly one block."""
    owners: dict[int, set[str]] = {}
    for name, block in blocks:
        for tname, t in _block_tensors(block):
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


def _fmt_bytes(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def enable_offload(
    transformer: nn.Module,
    offload_config: OffloadConfig,
    device: torch.device | str,
    *,
    activation_reserve_bytes: int | None = None,
    group: Any = None,
    host_plan: HostWeightPlan | None = None,
    block_lists: Sequence[str] | None = None,
) -> OffloadHandle:
    """Stream ``transformer``'s blocks from host memory through ``offload.slots`` device slots.

    ``group``: a torch.distributed process group; with more than one rank, each rank keeps
    1/group of every streamed block and rebuilds blocks with all_gather (AllGather mode).

    ``block_lists``: the streamed block lists in call order (the pipeline's declaration; by
    default the family's for the DiT class, see ``discovery``).

    ``host_plan``: the loader's HostWeightPlan (consumed here). A mapped plan streams straight
    from its read-only mappings: registered with ``pin_limit_gib`` > 0, else through two
    pinned staging slots (``staging``); in AllGather mode the shards are copied out of the
    mapping and the mapping is closed.

    All or nothing: raises ``OffloadError`` with a message that says how to fix the cause,
    leaving the model unchanged. The model must then be called with inputs on ``device``;
    do not move it with ``.to()`` while offload is enabled.
    """
    _check_config(offload_config, host_plan)
    group_size = _group_size(group)
    if group_size > 1 and (
        offload_config.resident_layers or offload_config.hbm_budget_gib is not None
    ):
        raise OffloadError(
            "resident layers are not supported with AllGather sharding (every rank would hold "
            "a full copy of them); drop resident_layers/hbm_budget_gib or run without a group "
            "(--dlo-no-use-allgather)"
        )
    if transformer in _ACTIVE:
        raise OffloadError(
            "offload is already enabled on this model; call handle.disable() before enabling "
            "it again"
        )
    found = discover(transformer, block_lists)
    _check_tensors(transformer, list(found.blocks))
    # More slots than blocks would only hold copies of blocks already in a slot.
    n_slots = min(
        offload_config.slots or (DEFAULT_ALLGATHER_SLOTS if group_size > 1 else DEFAULT_SLOTS),
        max(len(found.blocks), 2),
    )
    transfer = make_transfer(torch.device(device), n_slots)  # raises if the device is unusable
    target: torch.device = transfer.device

    block_tensors = [[t for _, t in _block_tensors(m)] for _, m in found.blocks]
    specs = [
        (
            name,
            [
                TensorSpec(tname, t.dtype, t.element_size(), tuple(t.shape))
                for tname, t in _block_tensors(module)
            ],
        )
        for name, module in found.blocks
    ]
    in_blocks = {id(t) for ts in block_tensors for t in ts}
    resident_tensors = [
        t
        for t in list(transformer.parameters()) + list(transformer.buffers())
        if id(t) not in in_blocks
    ]
    reserve = (
        DEFAULT_ACTIVATION_RESERVE_BYTES
        if activation_reserve_bytes is None
        else activation_reserve_bytes
    )
    budget = offload_config.hbm_budget_gib
    plan = build_plan(
        specs,
        resident_layers=offload_config.resident_layers,
        hbm_budget_bytes=None if budget is None else int(budget * GIB),
        resident_module_bytes=sum(t.numel() * t.element_size() for t in resident_tensors),
        activation_reserve_bytes=reserve,
        shard_multiple=group_size,
        slots=n_slots,
    )
    for index in plan.residency.resident:
        resident_tensors.extend(block_tensors[index])

    storage: HostStorage | ShardStorage | MappedStorage = HostStorage(transfer)
    mapped: MappedStorage | None = None
    if host_plan is not None and host_plan.mapped:
        if group_size == 1:
            mapped = storage = MappedStorage(host_plan)  # consumes the plan
        else:
            host_plan.consume()  # shards are copied out of its mapping below, then it closes
    if group_size > 1:
        try:
            rank = _group_rank(group)
            shards = [shard_block(plan.blocks[i], rank=rank, group_size=group_size)
                      for i in plan.streamed]
            gather_cls = (CopyEngineGather if offload_config.gather == "copy-engine"
                          else GatherTransfer)
            transfer = gather_cls(transfer, group, shard_slot_numel(shards))
        except Exception as e:
            transfer.close()
            raise OffloadError(
                f"could not set up AllGather offload over a group of {group_size}: "
                f"{type(e).__name__}: {e}"
            ) from e
        storage = ShardStorage(transfer, rank=rank, group_size=group_size)
    streamer: BlockStreamer | None = None
    journal: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, original data) to undo
    try:
        for index in plan.streamed:
            storage.add(plan.blocks[index], block_tensors[index])
        slot_layout = plan.slot
        slots = [
            {
                dtype: torch.empty(numel, dtype=dtype, device=target)  # type: ignore[arg-type]
                for dtype, _, numel in slot_layout.regions
            }
            for _ in range(n_slots)
        ]
        for t in resident_tensors:
            journal.append((t, t.data))
            t.data = t.data.to(target)
        if mapped is not None:
            # After the resident copies: a registered range is page-aligned, so a resident
            # tensor may share its edge page, and a copy that starts inside a registered
            # range but runs past its end is refused by the driver (invalid argument).
            transfer = make_mapped_transfer(
                transfer, mapped, slot_layout, pin_limit_gib=offload_config.pin_limit_gib
            )
        bases = {
            dtype: torch.zeros((), dtype=dtype, device=target)  # type: ignore[arg-type]
            for dtype, _, _ in slot_layout.regions
        }
        streamed = [
            make_streamed_block(
                plan.blocks[index],
                found.blocks[index][1],
                block_tensors[index],
                slots=slots,
                host_regions=storage.regions(index),
                placeholder_bases=bases,
            )
            for index in plan.streamed
        ]
        streamer = BlockStreamer(streamed, transfer, strict=group_size > 1)
        if group_size > 1:
            streamer.attach(root=transformer)  # completes passes even when a forward raises
        else:
            streamer.attach()
        # Commit: from here the streamed blocks' original tensors are released.
        for block in streamed:
            for t, ph in zip(block.tensors, block.placeholders, strict=True):
                journal.append((t, t.data))
                t.data = ph
    except Exception as e:
        if streamer is not None:
            streamer.detach()
        for t, original in reversed(journal):
            t.data = original
        storage.release_all()
        transfer.close()
        if host_plan is not None:
            host_plan.close()
        if isinstance(e, OffloadError):
            raise
        raise OffloadError(
            f"enabling offload failed and was undone: {type(e).__name__}: {e}; if the device "
            "or host ran out of memory, lower the resident blocks or free memory"
        ) from e
    journal.clear()

    handle = OffloadHandle(transformer, plan, target, transfer, storage, streamer, slots)
    handle.host_info = _host_info(host_plan, transfer, group_size)
    if host_plan is not None and mapped is None:
        host_plan.close()  # ordinary, or AllGather shards already copied out of the mapping
    _ACTIVE[transformer] = handle
    r = handle.report()
    log.info(
        "DLO on %s: %d blocks streamed (%s/step), %d resident (%s), slots %d x %s, "
        "host %s %s via %s",
        target,
        r["streamed_blocks"],
        _fmt_bytes(r["streamed_bytes"]),
        r["resident_blocks"],
        r["residency"],
        r["slots"],
        _fmt_bytes(r["slot_bytes"]),
        r["backing"],
        _fmt_bytes(r["host_bytes"]),
        r["transfer"],
    )
    return handle


def _host_info(host_plan: HostWeightPlan | None, transfer: Any, group_size: int) -> dict[str, Any]:
    info: dict[str, Any] = (
        host_plan.describe() if host_plan is not None
        else {"backing_kind": "ordinary", "backing_reason": "no HostWeightPlan given"}
    )
    if isinstance(transfer, MappedTransfer):
        return info | transfer.report()
    path = "allgather-shards" if group_size > 1 else "private-slabs"
    return info | {"transfer_path": path, "fallback_reason": None}


def _group_size(group: Any) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return int(dist.get_world_size(group))


def _group_rank(group: Any) -> int:
    import torch.distributed as dist

    return int(dist.get_rank(group))
