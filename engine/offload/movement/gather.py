"""AllGather transfer: rebuild each streamed block on the device from every rank's 1/group shard.

Same ``transfer.Transfer`` surface as the single-device paths, so ``hooks.BlockStreamer``
drives it unchanged. A load of block k into slot s takes ``(slot region, host shard)`` pairs,
one per dtype, and:

1. copies the rank's host shard into the next of three device *shard slots* (small buffers
   used in turn) on the copy stream - first waiting until the gather that last read that shard
   slot finished. Three, not two: the copy of block k+1 then waits only for the gather of
   block k-2, so a gather held back by compute never stalls the copy engine;
2. on the communication stream, waits for that copy and for the compute stream to release
   block slot s (write-after-read), then ``all_gather_into_tensor`` from the shard slot into
   the block slot's region, sized per block (blocks may differ in size);
3. records slot s's ``ready`` event on the communication stream; the compute stream waits on
   it before the block runs (``wait_ready``).

Only stream waits - the host never blocks per block - so block k+1's copy and gather overlap
block k's compute (``StreamGather``). On a CPU (gloo, in CI) the same steps run synchronously
in call order (``SyncGather``).

Every rank of the group must issue the same gathers in the same order: the streamer's state
machine is deterministic, so ranks that run the same sequence of forwards and idle passes
(``BlockStreamer.idle_pass``) stay matched. The plan's shard layout is checked once per
(block, slot) in ``prepare``, not per load.

Built by the backend's builders around a copy-stream transfer (whose copy stream and events it
reuses). ``gather_full`` rebuilds whole blocks on the host at disable (the shard backing's
``rebuild``; a function of the group, so a backing can be built before the transfer).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.movement.copy_stream import CudaStreamTransfer, SyncTransfer
from ditserve.engine.offload.movement.transfer import (
    CopyPairs,
    GatherFacts,
    MovementProbe,
    TransferReport,
)

SHARD_SLOTS = 3
Triples = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (slot region, host shard, shard slot)

# torch >= 2.13 renames all_gather_into_tensor (and deprecates the old name); older torch
# (the device image's 2.11) only has the old one. Same signature.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# gloo has no float8 types ("Invalid scalar type"); a gather moves bytes, so FP8 regions
# (weights of --quantization fp8 blocks) go through it as uint8 views.
_AS_BYTES = {torch.float8_e4m3fn, torch.float8_e5m2}


def all_gather_into(
    out: torch.Tensor, shard: torch.Tensor, *, group: dist.ProcessGroup | None = None
) -> None:
    """``all_gather_into_tensor(out, shard)`` (default group: the world) for any dtype of
    1-D tensors."""
    if shard.dtype in _AS_BYTES:
        out, shard = out.view(torch.uint8), shard.view(torch.uint8)
    _all_gather(out, shard, group=group)


def gather_full(
    shards: Mapping[Hashable, torch.Tensor], *, group: dist.ProcessGroup, device: torch.device
) -> dict[Hashable, torch.Tensor]:
    """A collective: every rank's shards of one block (per region key) -> the full regions,
    on the host. Synchronous; every rank of ``group`` must call it for the same block in the
    same order, with nothing of the block's loads in flight (the shard backing's ``rebuild``
    at disable, after the handle synchronized its transfer)."""
    size = dist.get_world_size(group)
    out: dict[Hashable, torch.Tensor] = {}
    for key, shard in shards.items():
        local = shard.to(device)
        full = torch.empty(shard.numel() * size, dtype=shard.dtype, device=device)
        all_gather_into(full, local, group=group)
        out[key] = full.cpu()  # (a no-op for a CPU tensor)
    return out


class GatherTransfer:
    """What both gathers share: shard slots in turn, byte counters, reports."""

    name = "h2d+allgather"

    def __init__(
        self,
        base: SyncTransfer | CudaStreamTransfer,
        group: dist.ProcessGroup,
        shard_slot: Mapping[Hashable, tuple[int, int]],  # dtype -> (itemsize, numel)
    ) -> None:
        self._base = base
        self.device: torch.device = base.device
        self.group = group
        self.group_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # Device shard slots, used in turn: the H2D target and the gather's input.
        self.shard_slots = self._make_shard_slots(shard_slot)
        self._next_shard = 0
        self.h2d_bytes = 0
        self.gathered_bytes = 0

    def _make_shard_slots(
        self, shard_slot: Mapping[Hashable, tuple[int, int]]
    ) -> list[dict[Hashable, torch.Tensor]]:
        """SHARD_SLOTS buffers per dtype in device memory (a subclass may place them
        elsewhere, e.g. in memory its peers can address)."""
        return [
            {
                dtype: torch.empty(numel, dtype=dtype, device=self.device)  # type: ignore[call-overload]
                for dtype, (_, numel) in shard_slot.items()
            }
            for _ in range(SHARD_SLOTS)
        ]

    def report(self) -> TransferReport:
        return TransferReport(self.name, "allgather-shards",
                              copy_rate=self._base.report().copy_rate,
                              gather=GatherFacts(self.h2d_bytes, self.gathered_bytes))

    def probe(self) -> MovementProbe:
        return MovementProbe(copy_stream=self._base.probe().copy_stream,
                             shard_slots=tuple(self.shard_slots))

    # -- loads ------------------------------------------------------------------------------------
    def prepare(self, pairs: Sequence[tuple[torch.Tensor, Any]], slot: int) -> CopyPairs:
        """Check once that each slot region is ``group_size`` shards long."""
        for dst, src in pairs:
            if dst.numel() != src.numel() * self.group_size:
                raise OffloadError(
                    f"a {dst.numel()}-element slot region cannot be gathered from "
                    f"{self.group_size} shards of {src.numel()}; the plan must be laid out "
                    f"with shard_multiple={self.group_size}"
                )
        return list(pairs)

    def _next_load(self, pairs: CopyPairs) -> tuple[int, Triples]:
        """Take the next shard slot j for a load and pair each (slot region, host shard) with
        its part of slot j; counts the bytes the load moves."""
        j = self._next_shard
        self._next_shard = (j + 1) % SHARD_SLOTS
        triples = []
        for dst, src in pairs:
            triples.append((dst, src, self.shard_slots[j][src.dtype][: src.numel()]))
            self.h2d_bytes += src.numel() * src.element_size()
            self.gathered_bytes += dst.numel() * dst.element_size()
        return j, triples

    def load(self, prepared: CopyPairs, slot: int) -> None:
        raise NotImplementedError  # SyncGather / StreamGather

    def wait_ready(self, slot: int) -> None:
        self._base.wait_ready(slot)

    def release(self, slot: int) -> None:
        self._base.release(slot)

    def synchronize(self) -> None:
        self._base.synchronize()

    def close(self) -> None:
        self.synchronize()
        self.shard_slots.clear()
        self._base.close()


class SyncGather(GatherTransfer):
    """CPU (gloo): each load's shard copies and gathers run on the calling thread."""

    def load(self, prepared: CopyPairs, slot: int) -> None:
        _, triples = self._next_load(prepared)
        for dst, src, shard in triples:
            shard.copy_(src)
            all_gather_into(dst, shard, group=self.group)


class StreamGather(GatherTransfer):
    """CUDA: shard H2D on the copy stream, gathers on the comm stream, ordered by events."""

    def __init__(
        self,
        base: CudaStreamTransfer,
        group: dist.ProcessGroup,
        shard_slot: Mapping[Hashable, tuple[int, int]],
    ) -> None:
        super().__init__(base, group, shard_slot)
        self._stream_base = base
        self.comm_stream = torch.cuda.Stream(device=self.device)
        # copied[j]: the H2D into shard slot j finished; gathered[j]: a gather read it.
        self.copied = [torch.cuda.Event() for _ in range(SHARD_SLOTS)]
        self.gathered = [torch.cuda.Event() for _ in range(SHARD_SLOTS)]

    def probe(self) -> MovementProbe:
        return MovementProbe(copy_stream=self._stream_base.stream, comm_stream=self.comm_stream,
                             shard_slots=tuple(self.shard_slots))

    def load(self, prepared: CopyPairs, slot: int) -> None:
        j, triples = self._next_load(prepared)
        copy, comm = self._stream_base.stream, self.comm_stream
        with torch.cuda.stream(copy):
            # Write-after-read on the shard slot: wait for the gather that last read it.
            copy.wait_event(self.gathered[j])
            self._copy_shards(j, triples)
        with torch.cuda.stream(comm):
            # Read-after-write on the shard slot; write-after-read on the block slot, whose
            # previous block may still be running on the compute stream.
            comm.wait_event(self.copied[j])
            comm.wait_event(self._stream_base.free[slot])
            for dst, _, shard in triples:
                # NCCL runs it on its own stream after everything queued on ``comm`` and makes
                # ``comm`` wait for it (async_op=False is a stream wait, not a host wait).
                all_gather_into(dst, shard, group=self.group)
            self.gathered[j].record(comm)
            self._stream_base.ready[slot].record(comm)

    def _copy_shards(self, j: int, triples: Triples) -> None:
        """On the copy stream, once shard slot j is free: H2D of this rank's shards into it,
        timed by the copy clock; records ``copied[j]``."""
        self._stream_base.copy_timed([(shard, src) for _, src, shard in triples])
        self.copied[j].record(self._stream_base.stream)

    def synchronize(self) -> None:
        self._base.synchronize()
        self.comm_stream.synchronize()

