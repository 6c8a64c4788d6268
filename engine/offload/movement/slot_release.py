"""Slot release: a streamed model's device slots given back between its passes.

A streamed text encoder runs once per request (one encode pass), then the DiT denoises for
tens of steps; slots the encoder kept would sit idle under the DiT's peak (a Mistral-24B
decoder layer is 0.9 GiB: two slots 1.8 GiB). ``SlotRelease`` owns the slot buffers of one
offload and frees their storages (``untyped_storage().resize_(0)``) when a pass ends, growing
them back to the same size (``resize_(nbytes)``) before the next pass loads a block. The
storage object stays the same, so every view prepared into it at enable time - the blocks'
parameter views, the transfers' prepared copies, the decoded regions' views - stays valid and
points into the new memory; the bytes a slot held are gone, so the streamer forgets which
block each slot held.

Ordering, with stream waits only (no host sync, at the pass boundary or elsewhere):

- release: the compute stream first waits for every slot's last load (``Transfer.wait_ready``:
  a copy, gather or decode still queued must land before its memory goes back). The storage is
  then freed on the compute stream, whose later allocations are queued behind everything that
  read or wrote the slot; ``record_stream`` covers slots allocated on another stream than the
  one computing now (the caching allocator then reuses them only once that work is done).
- restore: the fresh memory may be a block the compute stream used a moment ago (the DiT's
  activations, freed during its denoise). ``Transfer.release`` of every slot marks that point
  on the compute stream, so the first copy into a restored slot waits for it.

Both are idempotent. Rank-local offloads only (``backend`` refuses it with a group: AllGather
ranks' shard slots and signals outlive a pass). Driven by ``hooks.BlockStreamer`` at its pass
boundaries; built by ``backend`` for ``enable_offload(release_slots=True)`` (streamed text
encoders, ``engine.placement.encoder_streaming``).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch

from ditserve.engine.offload.movement.transfer import Transfer


class SlotRelease:
    """The slot storages of one offload, held during passes and given back between them."""

    def __init__(
        self,
        slots: Sequence[Mapping[Hashable, torch.Tensor]],
        transfer: Transfer,
        *,
        extra: Sequence[torch.Tensor] = (),
    ) -> None:
        """slots: per device slot, its flat buffer per dtype; extra: more per-slot device
        buffers released with them (``--dlo-dequant slot``'s decoded regions)."""
        self._transfer = transfer
        self._slot_count = len(slots)
        self._buffers: list[tuple[torch.Tensor, int]] = []  # (buffer, its storage's bytes)
        seen: set[int] = set()
        for tensor in [t for slot in slots for t in slot.values()] + list(extra):
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue  # a view of a buffer already owned, or nothing to give back
            seen.add(storage.data_ptr())
            self._buffers.append((tensor, storage.nbytes()))
        self.allocated = True
        self.releases = 0  # passes whose slots were given back (for tests and diagnostics)

    @property
    def nbytes(self) -> int:
        """Device bytes the slots hold while allocated."""
        return sum(nbytes for _, nbytes in self._buffers)

    def release(self) -> None:
        """Give the slot storages back to the allocator (see module docstring)."""
        if not self.allocated:
            return
        for slot in range(self._slot_count):
            # A stream wait per slot: nothing queued may still write into it once freed.
            self._transfer.wait_ready(slot)
        compute = (torch.cuda.current_stream(self._transfer.device)
                   if self._transfer.device.type == "cuda" else None)
        for tensor, _ in self._buffers:
            if compute is not None:
                # A no-op where the slot was allocated on the compute stream; otherwise its
                # reuse waits for the compute stream's reads queued so far.
                tensor.record_stream(compute)
            tensor.untyped_storage().resize_(0)
        self.allocated = False
        self.releases += 1

    def restore(self) -> None:
        """Grow the slot storages back to their size, ready for the next pass's loads."""
        if self.allocated:
            return
        for tensor, nbytes in self._buffers:
            tensor.untyped_storage().resize_(nbytes)
        for slot in range(self._slot_count):
            # Write-after-read on the new memory: a load into the slot waits for the compute
            # stream's work queued so far, which may have used these bytes before.
            self._transfer.release(slot)
        self.allocated = True
