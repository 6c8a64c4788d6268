"""Enable layerwise offload (DLO) on one device: the package's entry point.

``enable_offload`` turns a diffusers DiT into a streamed model, all or nothing, as a
composition of the steps in ``builders`` (the model side) and ``pairing`` (backing and
transfers): discover the block lists, plan layouts and
residency, open the device transfer, open the host backing and fill it (packing bf16 regions
with ``compress`` lossless), open the AllGather over a group (shard slots sized to the filled
backing), allocate the device slots (``offload.slots``; by default two, or eight with
AllGather), move resident modules to the device, open the mapped transfer or the decoding
transfer (packed runs; with ``dequant`` slot, GGUF layers into each slot's decoded region:
``slot_dequant``), attach the hooks, and only then swap the streamed blocks' tensors for
placeholders (with ``release_slots``, the slots then go back until the first pass:
``movement.slot_release``). Every step registers its undo on one ``contextlib.ExitStack``:
any failure unwinds what was done and raises ``OffloadError``; the model is left as it was.

The option rules are ``engine.config.offload_problems``'s; enable asserts them (with the
group it is given) unless the options are those of an engine config already judged
(``engine.config.judged``: the rules run once per config), and checks what it can once, here,
rather than on every load.

The returned ``OffloadHandle`` (``handle``) reports what is streamed and undoes it.

With ``group=`` a process group of size > 1 (AllGather mode), each rank keeps only its
1/group shard of every streamed block (``host.shard_slabs``) and loads rebuild blocks with
``all_gather_into_tensor`` (``movement.gather``); every rank of the group must then run the
same passes (forwards or ``OffloadHandle.idle_pass``), see ``hooks``.

Called by the engine's model runner (``--offload dlo``) and by the benchmarks in ``bench/``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import ditserve.engine.offload.builders as builders
import ditserve.engine.offload.pairing as pairing
from ditserve.engine.config import OffloadConfig, format_problems, judged, offload_problems
from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.accounting import host_accounting
from ditserve.engine.offload.discovery import discover
from ditserve.engine.offload.handle import _ACTIVE, OffloadHandle
from ditserve.engine.offload.host.weight_plan import HostWeightPlan
from ditserve.engine.offload.movement.slot_release import SlotRelease
from ditserve.engine.offload.movement.transfer import Transfer
from ditserve.engine.offload.plan import GIB
from ditserve.engine.offload.slot_dequant import open_slot_dequant

log = logging.getLogger(__name__)

# HBM kept free for activations when residency comes from --dlo-hbm-budget-gib; callers that
# know their batch and resolution pass ``activation_reserve_bytes`` instead.
DEFAULT_ACTIVATION_RESERVE_BYTES = 2 * GIB


def enable_offload(
    transformer: nn.Module,
    offload_config: OffloadConfig,
    device: torch.device | str,
    *,
    activation_reserve_bytes: int | None = None,
    group: Any = None,
    host_plan: HostWeightPlan | None = None,
    block_lists: Sequence[str] | None = None,
    host_modules: Sequence[nn.Module] = (),
    release_slots: bool = False,
) -> OffloadHandle:
    """Stream ``transformer``'s blocks from host memory through ``offload.slots`` device slots.

    ``group``: a torch.distributed process group; with more than one rank, each rank keeps
    1/group of every streamed block and rebuilds blocks with all_gather (AllGather mode).

    ``block_lists``: the streamed block lists in call order (the pipeline's declaration; by
    default the family's for the DiT class, see ``discovery``).

    ``host_plan``: the loader's HostWeightPlan (consumed here). A mapped plan streams straight
    from its read-only mappings: registered with ``pin_limit_gib`` > 0, else through two
    pinned staging slots (``movement.mapped``); in AllGather mode the shards are copied out
    of the mapping and the mapping is closed.

    ``host_modules``: modules outside the block lists that stay in host memory instead of
    moving to the device (a text encoder's token embedding, which looks its rows up on the
    host; an output head its pipeline never runs).

    ``release_slots``: give the slots' device memory back when a pass ends and take it again
    before the next one begins (``movement.slot_release``), for a model that runs seldom
    beside another that runs often (a streamed text encoder beside the DiT). Rank-local only.

    All or nothing: raises ``OffloadError`` with a message that says how to fix the cause,
    leaving the model unchanged. The model must then be called with inputs on ``device``;
    do not move it with ``.to()`` while offload is enabled.
    """
    group_size = _group_size(group)
    if release_slots and group_size > 1:
        raise OffloadError(
            "release_slots gives a rank-local offload's slots back between passes; AllGather "
            "ranks keep theirs (their loads are collectives) - drop release_slots or the group")
    _check_request(offload_config, host_plan, group_size)
    if transformer in _ACTIVE:
        raise OffloadError(
            "offload is already enabled on this model; call handle.disable() before enabling "
            "it again"
        )
    reserve = (DEFAULT_ACTIVATION_RESERVE_BYTES if activation_reserve_bytes is None
               else activation_reserve_bytes)
    try:
        with contextlib.ExitStack() as undo:
            handle = _enable(transformer, offload_config, torch.device(device), undo,
                             reserve=reserve, group=group, group_size=group_size,
                             host_plan=host_plan, block_lists=block_lists,
                             host_modules=host_modules, release_slots=release_slots)
            undo.pop_all()  # success: keep everything
    except OffloadError:
        raise
    except Exception as e:
        raise OffloadError(
            f"enabling offload failed and was undone: {type(e).__name__}: {e}; if the device "
            "or host ran out of memory, lower the resident blocks or free memory"
        ) from e
    _ACTIVE[transformer] = handle
    _log_enabled(handle)
    return handle


def _enable(
    model: nn.Module,
    config: OffloadConfig,
    device: torch.device,
    undo: contextlib.ExitStack,
    *,
    reserve: int,
    group: Any,
    group_size: int,
    host_plan: HostWeightPlan | None,
    block_lists: Sequence[str] | None,
    host_modules: Sequence[nn.Module],
    release_slots: bool = False,
) -> OffloadHandle:
    """The steps, in order (module docstring); each registers its undo on ``undo``."""
    plan_facts = (host_plan.describe() if host_plan is not None
                  else {"backing_kind": "ordinary", "backing_reason": "no HostWeightPlan given"})
    found = discover(model, block_lists)
    builders.check_tensors(model, found.blocks)
    slots = builders.slot_count(config, len(found.blocks), group_size)
    base = pairing.open_transfer(device, slots, undo)  # raises if the device is unusable
    split = builders.split_model(model, found, config, group_size=group_size, slots=slots,
                                 activation_reserve_bytes=reserve, host_modules=host_modules)
    backing, mapped = pairing.open_backing(host_plan, config, device=base.device, group=group,
                                           group_size=group_size, undo=undo)
    builders.fill(backing, split)
    if host_plan is not None and mapped is None:
        host_plan.close()  # ordinary, or copied out of the mapping (shards, packed slabs)
    transfer: Transfer = base
    if group_size > 1:  # shard slots sized to what this rank's loads copy
        sizes = pairing.shard_slot_sizes(backing, split.plan)
        transfer = pairing.open_gather(base, group, sizes, config.gather, undo)
    slot_buffers = builders.allocate_slots(split.plan.slot, slots, base.device)
    builders.move_to_device(split.resident_tensors, base.device, undo)
    if mapped is not None:
        transfer = pairing.open_mapped_transfer(base, mapped, split.plan, config, undo)
    if config.compress == "lossless":
        transfer = pairing.open_decoding(transfer, backing, split.plan, slots, undo)
    dequant = None
    if config.dequant == "slot":  # GGUF layers decoded into the slots (slot_dequant)
        dequant = open_slot_dequant(split.plan.streamed_blocks,
                                    [split.blocks[i][1] for i in split.plan.streamed],
                                    slots=slots, device=base.device)
        undo.callback(dequant.restore)
        transfer = pairing.open_decoding(transfer, backing, split.plan, slots, undo,
                                         in_place=True)
    release = (SlotRelease(slot_buffers, transfer,
                           extra=dequant.regions if dequant is not None else ())
               if release_slots and split.plan.streamed else None)
    streamer = builders.attach(model, split, backing=backing, transfer=transfer,
                               slots=slot_buffers, strict=group_size > 1, undo=undo,
                               dequant=dequant, slot_release=release)
    builders.swap_in_placeholders(streamer.blocks, undo)
    if release is not None:
        release.release()  # held from the first pass on, not from now
    return OffloadHandle(model, split.plan, base.device, transfer=transfer, backing=backing,
                         streamer=streamer, slots=slot_buffers, collective=group_size > 1,
                         host_plan=plan_facts, dequant=dequant, slot_release=release)


def _check_request(
    config: OffloadConfig, host_plan: HostWeightPlan | None, group_size: int
) -> None:
    """The config's own rules (``offload_problems``, with AllGather as the group makes it),
    and what the call needs: offload enabled, a plan for the options that act on one."""
    found = [] if judged(config) else (offload_problems(config, allgather=group_size > 1)
                                       + format_problems(config, group_size=group_size))
    if not config.enabled:
        found.insert(0, "offload.enabled is false; set it (--offload dlo) to enable offload")
    if host_plan is None and (config.runtime_cache or config.pin_limit_gib):
        found.append(
            "offload.runtime_cache / offload.pin_limit_gib act on the loader's HostWeightPlan; "
            "pass host_plan= (ModelRunner does) or unset them"
        )
    if found:
        raise OffloadError("cannot enable offload:\n  - " + "\n  - ".join(found))


def _log_enabled(handle: OffloadHandle) -> None:
    r = handle.snapshot()
    log.info(
        "DLO on %s: %d blocks streamed (%s/step), %d resident (%s), slots %d x %s, "
        "host %s %s via %s%s",
        r.device,
        r.streamed_blocks,
        _fmt_bytes(r.streamed_bytes),
        r.resident_blocks,
        r.residency,
        r.slots,
        _fmt_bytes(r.slot_bytes),
        r.host.backing,
        _fmt_bytes(r.host.host_bytes),
        r.transfer.name,
        ", slots given back between passes" if r.slots_released_between_passes else "",
    )
    accounting = host_accounting(r)
    log.info("%s", accounting.summary())
    for problem in accounting.problems:
        log.warning("DLO host memory: %s", problem)


def _fmt_bytes(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _group_size(group: Any) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return int(dist.get_world_size(group))
