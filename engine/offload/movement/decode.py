"""Decoding transfer: loads of coded host regions into slots - packed bf16 runs
(``--dlo-compress lossless``) and GGUF layers dequantized in the slot (``--dlo-dequant slot``).

Each coded source names a codec (``formats.slot_codecs``: staged bytes -> target view) and
where its bytes land: a packed run in the slot's *staging* buffer, decoded into the slot's bf16
region (below); a ``DecodeInPlace`` source (GGUF) in the slot's own region of its dtype (the
stored bytes, as a plain load puts them), decoded from there into a target of its own per slot
(the block's dequantized weights). Either way the decode is step 2 below.

Wraps the transfer the backing pairs with otherwise - the copy stream, or an AllGather - and
adds one step per load. A load of block k into device slot s:

1. the inner transfer moves the block's raw regions into the slot and its packed bytes into
   slot s's *staging* buffer, ordered as it orders any load (after compute released slot s),
   and records its ready event. With AllGather the staging buffer is the gather's target: each
   rank copies its stripes, ``all_gather_into_tensor`` rebuilds the packed run;
2. the decode stream waits for those bytes (``inner.wait_ready`` issued on it), decodes the
   staging bytes into the slot's bf16 region (``formats.packed_decode.decode_checked``: one
   Triton kernel per run, no allocation, no host sync) - or a GGUF block's bytes from the
   slot's uint8 region into its decoded region (diffusers' torch dequantizers: a few kernels
   per layer and their temporaries, allocated on the decode stream, no host sync) - and
   records this transfer's ``ready[s]``;
3. the compute stream waits on ``ready[s]`` before block k runs (``wait_ready``).

Why a stream of its own: the copy stream goes straight on to the next block's bytes while
block k decodes, so the copies stay back to back (the step's floor is the packed bytes over
the link rate) and the decode (about 0.2-0.3 ms per Flux block) overlaps the copy of the
next block and the compute of the previous one.

Write-after-read: the inner load of slot s waits for compute's release of s; ``release(s)``
first makes the compute stream wait for slot s's decode - a no-op in the steady state, where
compute already waited on it before running the block, but not when a prefetched block never
ran (a miss) - so a released slot's staging, bf16 region and decoded region are no longer
being written, and the next decode into slot s (after the next copy into s, which waits for
compute's release) never overwrites weights a block still reads.

On a CPU every step runs synchronously in call order (CI runs this path).

Built by the backend's builders around the inner transfer; driven by ``hooks.BlockStreamer``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ditserve.engine.formats.slot_codecs import Decode, PackedCodec, SlotCodec
from ditserve.engine.offload.host.packed_slabs import PackedSource
from ditserve.engine.offload.movement.transfer import DelegatingTransfer, Transfer, TransferReport


@dataclass(frozen=True)
class DecodeInPlace:
    """A host region copied as stored into the slot's region of its dtype, then decoded
    from there by ``codec`` into ``targets[slot]`` (GGUF layers: their dequantized weights)."""

    data: Any  # the backing's copy source, moved by the inner transfer unchanged
    codec: SlotCodec
    targets: tuple[torch.Tensor, ...]  # per slot: the device view the codec writes


@dataclass(frozen=True)
class PackedLoad:
    """A prepared load: the inner transfer's, and the runs to decode once its bytes landed."""

    inner: Any
    runs: tuple[Decode, ...]  # each codec bound to its (staged bytes, target) pair


def largest_run(sources: Iterable[Any]) -> int:
    """Bytes of the largest whole packed run among host sources (a staging buffer's size)."""
    return max((s.layout.nbytes for s in sources if isinstance(s, PackedSource)), default=0)


def copy_source(source: Any) -> Any:
    """What the inner transfer moves for a host source: a packed region's bytes, or the
    source itself (sizes an AllGather's shard slots)."""
    return source.data if isinstance(source, PackedSource | DecodeInPlace) else source


class DecodingTransfer(DelegatingTransfer):
    """Copies (or gathers) coded bytes into the slot (or its staging), then decodes them."""

    def __init__(self, inner: Transfer, *, slots: int, staging_bytes: int) -> None:
        """staging_bytes: the largest packed run a slot receives (one buffer per slot; 0
        when only in-place sources decode, whose targets the caller owns as slot regions)."""
        super().__init__(inner)
        self.staging = [torch.empty(staging_bytes, dtype=torch.uint8, device=self.device)
                        for _ in range(slots)]
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if cuda else None
        # ready[s]: slot s's bytes landed and its packed runs are decoded.
        self.ready = [torch.cuda.Event() for _ in range(slots)] if cuda else []
        self.decoded_runs = 0

    def prepare(self, pairs: Sequence[tuple[torch.Tensor, Any]], slot: int) -> PackedLoad:
        """Route each packed source through slot ``slot``'s staging and each in-place source
        into the slot; every (codec, staged, target) is checked here, once."""
        inner_pairs: list[tuple[torch.Tensor, Any]] = []
        runs: list[Decode] = []
        for dst, src in pairs:
            if isinstance(src, PackedSource):
                staged = self.staging[slot][: src.layout.nbytes]
                runs.append(PackedCodec(src.layout).bind(staged, dst))
                inner_pairs.append((staged, src.data))
            elif isinstance(src, DecodeInPlace):
                runs.append(src.codec.bind(dst, src.targets[slot]))
                inner_pairs.append((dst, src.data))
            else:
                inner_pairs.append((dst, src))
        return PackedLoad(self.inner.prepare(inner_pairs, slot), tuple(runs))

    def load(self, prepared: PackedLoad, slot: int) -> None:
        self.inner.load(prepared.inner, slot)
        self.decoded_runs += len(prepared.runs)
        if self.stream is None:  # CPU: the bytes are already there
            for decode in prepared.runs:
                decode()
            return
        with torch.cuda.stream(self.stream):
            # Read-after-write on the staging buffer: the inner transfer's ready event (its
            # copy, or its gather) becomes a wait of the decode stream, not of the host.
            self.inner.wait_ready(slot)
            for decode in prepared.runs:
                decode()
            self.ready[slot].record(self.stream)

    def wait_ready(self, slot: int) -> None:
        if self.stream is None:
            self.inner.wait_ready(slot)
            return
        # Read-after-write on the slot: the block's kernels start after its decode.
        torch.cuda.current_stream(self.device).wait_event(self.ready[slot])

    def release(self, slot: int) -> None:
        if self.stream is not None:
            # A slot is released only once its decode is done (see module docstring).
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
        super().release(slot)

    def synchronize(self) -> None:
        super().synchronize()
        if self.stream is not None:
            self.stream.synchronize()

    def close(self) -> None:
        self.synchronize()
        self.staging.clear()
        super().close()

    def report(self) -> TransferReport:
        inner = self.inner.report()
        return TransferReport(
            f"{inner.name}+decode", inner.path, pinned_bytes=inner.pinned_bytes,
            copy_rate=inner.copy_rate, gather=inner.gather,
            device_staging_bytes=inner.device_staging_bytes + sum(
                s.numel() for s in self.staging))
