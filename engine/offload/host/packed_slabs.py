"""Packed backing (``--dlo-compress lossless``): each streamed block's bf16 region held in the
lossless 12-bit packed form (``engine.formats``), its other dtype regions raw, in one slab.

A block's slab is its raw (non-bf16) regions back to back, then the packed bytes of its bf16
region; every part starts ``ALIGN_BYTES``-aligned. The slab comes from a ``memory.HostMemory``
(page-locked in place on CUDA), so pinned host memory is the packed bytes plus alignment: about
0.75 of the plain slabs for a bf16 DiT.

Encoding happens once, in ``add``: the block's bf16 region is assembled on ``encode_device``
and packed there (on CUDA at device speed, the host gets only the packed bytes back; on a CPU
with the CPU encoder, for tests). The packing is deterministic, so every rank of an AllGather
group packs the same bytes and keeps only its stripes (``PackedLayout.shard_range``) and its
1/group slice of each raw region (``shards.shard_block``): gathering the ranks' stripes
rebuilds the packed run byte for byte, which is then decoded. ``group_size`` 1 is the
rank-local case (the whole record).

``regions`` hands the transfer raw regions as tensors and the packed region as a
``PackedSource`` (layout + host bytes), which ``movement.decode`` copies into a device staging
buffer and decodes into the slot's bf16 region. ``release`` decodes the blocks back into
ordinary bf16 host tensors (on ``encode_device``), gathering the stripes first with
``gather=True`` in AllGather mode.

Built by the backend's builders; read by the hooks (copy sources) and ``handle``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ditserve.engine.errors import OffloadError
from ditserve.engine.formats.packed_decode import decode_into
from ditserve.engine.formats.packed_encode import encode
from ditserve.engine.formats.packed_layout import DEFAULT_STRIPES, FORMAT, PackedBf16, PackedLayout
from ditserve.engine.offload.host.backing import BackingReport, PackedFacts, ShardFacts
from ditserve.engine.offload.host.memory import HostMemory
from ditserve.engine.offload.plan import ALIGN_BYTES, BlockLayout, round_up
from ditserve.engine.offload.shards import BlockShard, RegionShard, shard_block

PACKED_DTYPE = torch.bfloat16  # the only dtype the packing encodes
# The key a packed run's bytes travel under in an AllGather rebuild (``gather_full``).
PACKED_BYTES = torch.uint8
Rebuild = Callable[[Mapping[Hashable, torch.Tensor]], Mapping[Hashable, torch.Tensor]]


@dataclass(frozen=True)
class PackedSource:
    """The copy source of a block's packed bf16 region: the run's layout and the host bytes
    this rank holds (the whole run, or its stripes in AllGather mode)."""

    layout: PackedLayout
    data: torch.Tensor  # flat uint8, host


@dataclass
class _Record:
    layout: BlockLayout
    shard: BlockShard
    slab: torch.Tensor
    raw: list[tuple[RegionShard, int]]  # raw region slices and their byte offsets in the slab
    packed: PackedLayout | None  # None: the block has no bf16 region
    packed_offset: int


class PackedBacking:
    """Packed slabs of the streamed blocks for one rank of ``group_size`` (a ``HostBacking``)."""

    def __init__(
        self,
        memory: HostMemory,
        *,
        encode_device: torch.device,
        rank: int = 0,
        group_size: int = 1,
        rebuild: Rebuild | None = None,
        stripes: int = DEFAULT_STRIPES,
    ) -> None:
        if stripes % group_size:
            raise OffloadError(f"packed runs of {stripes} stripes cannot be shared by a group of "
                               f"{group_size}; use a group size dividing {stripes}")
        self._memory = memory
        self._device = encode_device
        self.rank = rank
        self.group_size = group_size
        self._rebuild = rebuild
        self._stripes = stripes
        self._records: dict[int, _Record] = {}

    @property
    def nbytes(self) -> int:
        return sum(r.slab.numel() for r in self._records.values())

    def report(self) -> BackingReport:
        runs = [r.packed for r in self._records.values() if r.packed is not None]
        g = self.group_size
        facts = PackedFacts(FORMAT, self._stripes, packed_bytes=sum(p.nbytes for p in runs) // g,
                            raw_bytes=sum(p.raw_nbytes for p in runs) // g,
                            escapes=sum(p.escapes for p in runs))
        kind = f"{self._memory.kind}-packed" + ("-shards" if g > 1 else "")
        shard = ShardFacts(g, self.rank, self.nbytes) if g > 1 else None
        return BackingReport(kind, self.nbytes, self._memory.pinned_bytes, shard=shard,
                             packed=facts)

    def add(self, layout: BlockLayout, tensors: Sequence[torch.Tensor]) -> None:
        """Pack the block's bf16 region, then fill its slab with this rank's part of it and of
        the raw regions."""
        if any(r.dtype == PACKED_BYTES for r in layout.regions):
            raise OffloadError(f"block {layout.name} holds uint8 tensors, which collide with the "
                               "packed bytes' region; run it without --dlo-compress")
        shard = shard_block(layout, rank=self.rank, group_size=self.group_size)
        packed = self._encode(layout, tensors)
        raw, cursor = [], 0
        for region in shard.regions:
            if packed is None or region.dtype != PACKED_DTYPE:
                raw.append((region, cursor))
                cursor += round_up(region.nbytes, ALIGN_BYTES)
        share = packed.layout.nbytes // self.group_size if packed is not None else 0
        slab = self._memory.allocate(cursor + share)
        slab[:cursor].zero_()  # padding between and after tensors: deterministic bytes
        record = _Record(layout, shard, slab, raw, packed.layout if packed else None, cursor)
        self._records[layout.index] = record
        views = {region.dtype: self._raw_view(record, region, off) for region, off in raw}
        for piece in shard.pieces:
            if piece.dtype in views:
                src = tensors[piece.tensor].detach().reshape(-1)[piece.src : piece.src + piece.count]
                views[piece.dtype][piece.dst : piece.dst + piece.count].copy_(src)
        if packed is not None:
            slab[cursor:].copy_(packed.shard(self.rank, self.group_size))  # D2H from a GPU pack

    def _encode(self, layout: BlockLayout, tensors: Sequence[torch.Tensor]) -> PackedBf16 | None:
        region = next((r for r in layout.regions if r.dtype == PACKED_DTYPE), None)
        if region is None:
            return None
        device = self._device
        # The whole bf16 region (zero padding included, as in a plain slab) on the encoder's
        # device: one block at a time, so the device holds at most one block's temporaries.
        flat = torch.zeros(region.numel, dtype=PACKED_DTYPE, device=device)
        for tensor, placed in zip(tensors, layout.tensors, strict=True):
            if placed.dtype == PACKED_DTYPE:
                flat[placed.offset : placed.offset + placed.numel].copy_(tensor.detach().reshape(-1))
        return encode(flat, stripes=self._stripes,
                      allocate=lambda n: torch.empty(n, dtype=torch.uint8, device=device))

    @staticmethod
    def _raw_view(record: _Record, region: RegionShard, offset: int) -> torch.Tensor:
        return record.slab[offset : offset + region.nbytes].view(region.dtype)  # type: ignore[arg-type]

    def regions(self, index: int) -> dict[Hashable, torch.Tensor | PackedSource]:
        """Per dtype, the copy source of the block's region: raw regions (this rank's slice)
        as tensors, the bf16 region as a ``PackedSource``."""
        record = self._records[index]
        out: dict[Hashable, torch.Tensor | PackedSource] = {
            region.dtype: self._raw_view(record, region, off) for region, off in record.raw}
        if record.packed is not None:
            out[PACKED_DTYPE] = PackedSource(record.packed, record.slab[record.packed_offset :])
        return out

    def release(self, index: int, *, gather: bool = False) -> list[torch.Tensor]:
        """Forget block ``index``; its tensors as ordinary host tensors (the bf16 region
        decoded). AllGather mode: rebuilt from every rank's parts with ``gather`` (a
        collective), else empty tensors."""
        record = self._records.pop(index)
        layout, g = record.layout, self.group_size
        if g > 1 and not gather:
            self._memory.free(record.slab)
            return [torch.empty(0, dtype=p.dtype) for p in layout.tensors]  # type: ignore[arg-type]
        parts: dict[Hashable, torch.Tensor] = {
            region.dtype: self._raw_view(record, region, off) for region, off in record.raw}
        if record.packed is not None:
            parts[PACKED_BYTES] = record.slab[record.packed_offset :]
        if g > 1:
            assert self._rebuild is not None, "an AllGather packed backing needs its rebuild"
            parts = dict(self._rebuild(parts))
        packed = parts.pop(PACKED_BYTES, None)
        if record.packed is not None and packed is not None:
            parts[PACKED_DTYPE] = self._decode(record.packed, packed)
        if not self._memory.free(record.slab) and g == 1:  # raw views of a still-pinned slab
            parts = {k: v if k == PACKED_DTYPE else v.clone() for k, v in parts.items()}
        return [parts[p.dtype][p.offset : p.offset + p.numel].view(p.shape) for p in layout.tensors]

    def _decode(self, layout: PackedLayout, data: torch.Tensor) -> torch.Tensor:
        """A packed run's values as a new bf16 host tensor, decoded on the encoder's device."""
        out = torch.empty(layout.numel, dtype=PACKED_DTYPE, device=self._device)
        decode_into(PackedBf16(layout, data.to(self._device)), out)
        return out.cpu()

    def close(self) -> None:
        for index in list(self._records):
            self._memory.free(self._records.pop(index).slab)
