"""Copy-engine gather: rebuild each block from the ranks' shards with peer-to-peer DMA, no SMs.

The NCCL path (``gather.StreamGather``) runs every block's ``all_gather`` as a kernel that
takes SMs from the blocks' compute and slows the host copies running beside it (measured on
2 x H200). Here each rank's device shard slots live in CUDA symmetric memory
(``torch.distributed._symmetric_memory``): every rank can address every other rank's slots,
so a block is rebuilt with plain ``cudaMemcpyAsync`` copies - one local, one per peer, over
NVLink - which the GPU's copy engines execute. Only small signal kernels run on SMs.

A load of block k (shard slot j, block slot s):

1. copy stream: wait until every peer signalled that it finished reading this rank's shard
   slot j (its previous use; skipped for a slot's first use), then H2D of the local shard into
   slot j, then signal every peer "slot j is ready";
2. gather stream: wait for the compute stream to release block slot s (write-after-read) and
   for the local H2D, then for each peer's "slot j is ready" signal; copy the local shard and
   each peer's shard into their places in the block slot; signal each peer "done reading your
   slot j"; record slot s's ``ready`` event, on which the compute stream waits.

Signals are one-bit semaphores per (peer, channel) that alternate strictly - a put is always
consumed by the next wait before the next put for the same slot - because every rank issues
the same loads in the same order (``hooks``: whole passes). ``gather_full`` (rebuilding blocks
on the host at disable) stays on NCCL.

Chosen by the backend's builders with ``offload.gather = "copy-engine"``; needs CUDA and a
group whose ranks share one host with peer access (symmetric memory refuses otherwise, and
enable fails with the reason).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch
import torch.distributed as dist

from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.movement.copy_stream import CudaStreamTransfer
from ditserve.engine.offload.movement.gather import SHARD_SLOTS, StreamGather
from ditserve.engine.offload.movement.transfer import CopyPairs

READY, READ = 0, 1  # signal kinds; channel = kind * SHARD_SLOTS + shard slot


def _channel(kind: int, slot: int) -> int:
    return kind * SHARD_SLOTS + slot


class CopyEngineGather(StreamGather):
    """H2D of the local shard + peer-to-peer copies into the block slot (module docstring)."""

    name = "h2d+p2p-copy"

    def __init__(
        self,
        base: CudaStreamTransfer,
        group: dist.ProcessGroup,
        shard_slot: Mapping[Hashable, tuple[int, int]],
    ) -> None:
        if base.device.type != "cuda":
            raise OffloadError("offload.gather='copy-engine' needs CUDA devices; use 'nccl'")
        super().__init__(base, group, shard_slot)
        self.peers = [r for r in range(self.group_size) if r != self.rank]
        # Any handle's signal pads will do: one set of signals orders all dtypes of a load.
        self._signals = next(iter(self._handles.values()))
        self._used = [False] * SHARD_SLOTS  # shard slot j has been loaded before

    def _make_shard_slots(
        self, shard_slot: Mapping[Hashable, tuple[int, int]]
    ) -> list[dict[Hashable, torch.Tensor]]:
        """One symmetric buffer per dtype holding the SHARD_SLOTS slots back to back."""
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # older torch needs it first
            symm_mem.enable_symm_mem_for_group(self.group.group_name)
        self._handles: dict[Hashable, object] = {}
        self._numel: dict[Hashable, int] = {}
        buffers = {}
        for dtype, (_, numel) in shard_slot.items():
            numel = max(numel, 1)
            buffer = symm_mem.empty(SHARD_SLOTS * numel, dtype=dtype, device=self.device)  # type: ignore[call-overload]
            self._handles[dtype] = symm_mem.rendezvous(buffer, self.group.group_name)
            self._numel[dtype] = numel
            buffers[dtype] = buffer
        return [{dtype: buf[j * self._numel[dtype] : (j + 1) * self._numel[dtype]]
                 for dtype, buf in buffers.items()}
                for j in range(SHARD_SLOTS)]

    def _peer_shard(self, peer: int, dtype: Hashable, slot: int, n: int) -> torch.Tensor:
        offset = slot * self._numel[dtype]
        return self._handles[dtype].get_buffer(  # type: ignore[attr-defined]
            peer, (n,), dtype, offset)

    def load(self, prepared: CopyPairs, slot: int) -> None:
        j, triples = self._next_load(prepared)
        signals = self._signals
        copy, comm = self._stream_base.stream, self.comm_stream
        with torch.cuda.stream(copy):
            if self._used[j]:
                # Write-after-read across ranks: every peer copied our slot j's last contents.
                for peer in self.peers:
                    signals.wait_signal(peer, _channel(READ, j))  # type: ignore[attr-defined]
            self._used[j] = True
            self._copy_shards(j, triples)
            for peer in self.peers:
                signals.put_signal(peer, _channel(READY, j))  # type: ignore[attr-defined]
        with torch.cuda.stream(comm):
            comm.wait_event(self._stream_base.free[slot])
            comm.wait_event(self.copied[j])
            for peer in self.peers:
                signals.wait_signal(peer, _channel(READY, j))  # type: ignore[attr-defined]
            for dst, src, shard in triples:
                n = src.numel()
                parts = dst.view(self.group_size, n)
                parts[self.rank].copy_(shard, non_blocking=True)
                for peer in self.peers:
                    parts[peer].copy_(self._peer_shard(peer, src.dtype, j, n), non_blocking=True)
            for peer in self.peers:
                signals.put_signal(peer, _channel(READ, j))  # type: ignore[attr-defined]
            self._stream_base.ready[slot].record(comm)

    def close(self) -> None:
        # Peers map these buffers themselves, so dropping ours cannot pull memory from under a
        # peer's last copy; a peer's last "done reading" signal is simply never consumed.
        super().close()
        self._handles.clear()
