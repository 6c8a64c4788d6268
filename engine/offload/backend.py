"""Enable and disable layerwise offload (DLO) on one device: the package's entry point.

``enable_offload`` turns a diffusers DiT into a streamed model, all or nothing: discover the
block lists, plan layouts and residency, fill one host slab per streamed block, allocate two
device slots, move resident modules to the device, attach the hooks, and only then swap the
streamed blocks' tensors for placeholders. Any failure undoes every step and raises
``OffloadError``; the model is left as it was.

``OffloadHandle.disable`` synchronizes, removes the hooks, gives the streamed blocks back
ordinary (pageable, unpinned) host tensors - views of the former slabs, no copy - and frees
the slots. Resident modules stay on the device: call ``model.to(device)`` afterwards to run
it fully resident, or ``enable_offload`` again.

Called by the engine's model runner (``--offload dlo``) and by ``bench/offload.py``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from ditserve.engine.config import OffloadConfig, offload_problems
from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.discovery import discover
from ditserve.engine.offload.hooks import BlockStreamer, make_streamed_block
from ditserve.engine.offload.host import HostStorage
from ditserve.engine.offload.plan import GIB, OffloadPlan, TensorSpec, build_plan
from ditserve.engine.offload.transfer import make_transfer

log = logging.getLogger(__name__)

# HBM kept free for activations when residency comes from --dlo-hbm-budget-gib; callers that
# know their batch and resolution pass ``activation_reserve_bytes`` instead.
DEFAULT_ACTIVATION_RESERVE_BYTES = 2 * GIB

_ACTIVE: weakref.WeakKeyDictionary[nn.Module, OffloadHandle] = weakref.WeakKeyDictionary()


def _block_tensors(block: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(block.named_parameters()) + list(block.named_buffers())


def _check_config(config: OffloadConfig) -> None:
    found = offload_problems(config)
    if not config.enabled:
        found.insert(0, "offload.enabled is false; set it (--offload dlo) to enable offload")
    if config.runtime_cache:
        found.append(
            "offload.runtime_cache backings are not implemented in this build; unset it"
        )
    if config.pin_limit_gib:
        found.append(
            "offload.pin_limit_gib applies to mmap backings, not implemented in this build; "
            "set it to 0"
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


class OffloadHandle:
    """A live offload of one model: ``report()`` what it does, ``disable()`` to undo it."""

    def __init__(
        self,
        model: nn.Module,
        plan: OffloadPlan,
        device: torch.device,
        transfer: Any,
        storage: HostStorage,
        streamer: BlockStreamer,
        slots: list[dict[Hashable, torch.Tensor]],
    ) -> None:
        self._model = weakref.ref(model)
        self.plan = plan
        self.device = device
        self._transfer = transfer
        self._storage = storage
        self._streamer = streamer
        self._slots = slots
        self.active = True

    def report(self) -> dict[str, Any]:
        """JSON-able facts: the split, bytes per step, memory, backing and transfer so far."""
        plan, streamer = self.plan, self._streamer
        names = [b.name for b in plan.blocks]
        return {
            "active": self.active,
            "device": str(self.device),
            "blocks": len(plan.blocks),
            "streamed_blocks": len(plan.streamed),
            "resident_blocks": len(plan.residency.resident),
            "resident_block_names": [names[i] for i in plan.residency.resident],
            "residency": plan.residency.mode,
            "hbm_budget_bytes": plan.residency.budget_bytes,
            "activation_reserve_bytes": plan.residency.activation_reserve_bytes,
            "streamed_bytes": plan.streamed_bytes,
            "resident_block_bytes": plan.resident_block_bytes,
            "resident_module_bytes": plan.resident_module_bytes,
            "slot_bytes": plan.slot.nbytes,
            "slots": 2 if plan.streamed else 0,
            "host_bytes": self._storage.nbytes,
            "pinned_host_bytes": self._transfer.pinned_bytes,
            "backing": self._transfer.backing,
            "transfer": self._transfer.name,
            "bytes_transferred": streamer.bytes_transferred,
            "block_loads": streamer.loads,
            "load_misses": streamer.misses,
        }

    def disable(self) -> None:
        """Synchronize, remove hooks, restore ordinary host tensors, free slabs and slots.

        Idempotent. Streamed blocks end up on the CPU (pageable memory, no copy); resident
        modules stay on the device.
        """
        if not self.active:
            return
        self._transfer.synchronize()
        self._streamer.detach()
        for position, index in enumerate(self.plan.streamed):
            block = self._streamer.blocks[position]
            for tensor, host in zip(block.tensors, self._storage.release(index), strict=True):
                tensor.data = host
        self._slots.clear()
        self._streamer.blocks.clear()
        self._transfer.close()
        self.active = False
        model = self._model()
        if model is not None:
            _ACTIVE.pop(model, None)


def enable_offload(
    transformer: nn.Module,
    offload_config: OffloadConfig,
    device: torch.device | str,
    *,
    activation_reserve_bytes: int | None = None,
) -> OffloadHandle:
    """Stream ``transformer``'s blocks from host memory through two slots on ``device``.

    All or nothing: raises ``OffloadError`` with a message that says how to fix the cause,
    leaving the model unchanged. The model must then be called with inputs on ``device``;
    do not move it with ``.to()`` while offload is enabled.
    """
    _check_config(offload_config)
    transfer = make_transfer(torch.device(device))  # raises if the device is unusable
    target: torch.device = transfer.device
    if transformer in _ACTIVE:
        raise OffloadError(
            "offload is already enabled on this model; call handle.disable() before enabling "
            "it again"
        )
    found = discover(transformer)
    _check_tensors(transformer, list(found.blocks))

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
    )
    for index in plan.residency.resident:
        resident_tensors.extend(block_tensors[index])

    storage = HostStorage(transfer)
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
            for _ in range(2)
        ]
        for t in resident_tensors:
            journal.append((t, t.data))
            t.data = t.data.to(target)
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
        streamer = BlockStreamer(streamed, transfer)
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
        if isinstance(e, OffloadError):
            raise
        raise OffloadError(
            f"enabling offload failed and was undone: {type(e).__name__}: {e}; if the device "
            "or host ran out of memory, lower the resident blocks or free memory"
        ) from e
    journal.clear()

    handle = OffloadHandle(transformer, plan, target, transfer, storage, streamer, slots)
    _ACTIVE[transformer] = handle
    r = handle.report()
    log.info(
        "DLO on %s: %d blocks streamed (%s/step), %d resident (%s), slots 2 x %s, "
        "host %s %s via %s",
        target,
        r["streamed_blocks"],
        _fmt_bytes(r["streamed_bytes"]),
        r["resident_blocks"],
        r["residency"],
        _fmt_bytes(r["slot_bytes"]),
        r["backing"],
        _fmt_bytes(r["host_bytes"]),
        r["transfer"],
    )
    return handle
