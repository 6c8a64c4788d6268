"""The offload plan: which blocks stream, and how each block's tensors lie in flat memory.

Pure: built from tensor metadata (names, dtypes, shapes, item sizes), never from tensors, and
imports no torch, so it is tested alone and reused as is by the distributed backend, which
shards every block's per-dtype flat region over a group (``shard_multiple``).

Layout of one streamed block (the same in its host slab and in a device slot):
one flat region per dtype, tensors packed in registration order, each starting
``ALIGN_BYTES``-aligned. The slab holds the regions back to back; a slot holds one flat
buffer per dtype, sized to the largest streamed block's region of that dtype.

Called by the backend's builders; read by the ``host`` backings (slab layout), ``movement`` (copy
sizes) and ``hooks`` (views into slots).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ditserve.engine.errors import OffloadError

# Every tensor starts 256-byte aligned in slabs and slots: the same alignment cudaMalloc
# gives a fresh tensor, so GEMM kernels pick the same (vectorized) code paths on views.
ALIGN_BYTES = 256
GIB = 1024**3


@dataclass(frozen=True)
class TensorSpec:
    """One parameter or buffer of a block, as metadata. ``name`` is its path in the block."""

    name: str
    dtype: Hashable
    itemsize: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class TensorPlacement:
    """Where one tensor lies: ``offset`` elements into its dtype's flat region."""

    name: str
    dtype: Hashable
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class DtypeRegion:
    """One dtype's flat region of a block: ``numel`` elements (padded) at ``host_offset`` bytes."""

    dtype: Hashable
    itemsize: int
    numel: int
    host_offset: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class BlockLayout:
    """A block's flat layout. ``nbytes`` is its slab size (what one load moves)."""

    index: int
    name: str
    regions: tuple[DtypeRegion, ...]
    tensors: tuple[TensorPlacement, ...]
    payload_bytes: int

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions)


@dataclass(frozen=True)
class SlotLayout:
    """One device slot: ``numel`` elements per dtype (the largest streamed region of it)."""

    regions: tuple[tuple[Hashable, int, int], ...]  # (dtype, itemsize, numel)

    @property
    def nbytes(self) -> int:
        return sum(itemsize * numel for _, itemsize, numel in self.regions)


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


def layout_block(
    index: int, name: str, tensors: Sequence[TensorSpec], *, shard_multiple: int = 1
) -> BlockLayout:
    """Pack a block's tensors into per-dtype flat regions (dtypes in first-seen order).

    ``shard_multiple`` pads each region to a multiple of it, so a group of that size can
    split the region into equal shards (1 on a single device).
    """
    by_dtype: dict[Hashable, list[TensorSpec]] = {}
    for spec in tensors:
        by_dtype.setdefault(spec.dtype, []).append(spec)
    regions: list[DtypeRegion] = []
    placed: dict[int, TensorPlacement] = {}  # id(spec) -> placement
    host_offset = 0
    for dtype, specs in by_dtype.items():
        itemsize = specs[0].itemsize
        align = max(1, ALIGN_BYTES // itemsize)
        cursor = 0
        for spec in specs:
            cursor = round_up(cursor, align)
            placed[id(spec)] = TensorPlacement(spec.name, dtype, spec.shape, cursor, spec.numel)
            cursor += spec.numel
        numel = round_up(round_up(cursor, align), align * shard_multiple)
        regions.append(DtypeRegion(dtype, itemsize, numel, host_offset))
        host_offset += numel * itemsize  # stays ALIGN_BYTES-aligned: numel is a multiple of align
    payload = sum(s.numel * s.itemsize for s in tensors)
    # Placements stay in the caller's order (not grouped by dtype): callers zip them with the
    # block's tensors, listed in that order, even when dtypes interleave.
    placements = tuple(placed[id(spec)] for spec in tensors)
    return BlockLayout(index, name, tuple(regions), placements, payload)


def slot_layout(blocks: Sequence[BlockLayout]) -> SlotLayout:
    """The slot every streamed block fits in: per dtype, the largest region of that dtype."""
    sizes: dict[Hashable, tuple[int, int]] = {}
    for block in blocks:
        for r in block.regions:
            _, numel = sizes.get(r.dtype, (r.itemsize, 0))
            sizes[r.dtype] = (r.itemsize, max(numel, r.numel))
    return SlotLayout(tuple((d, item, n) for d, (item, n) in sizes.items()))


@dataclass(frozen=True)
class Residency:
    """Which blocks stay on the device, and why (for the startup report)."""

    mode: str  # "none" | "resident_layers" | "hbm_budget"
    resident: tuple[int, ...]
    budget_bytes: int | None = None
    activation_reserve_bytes: int | None = None


def leading_residency(num_blocks: int, resident_layers: int) -> Residency:
    """Keep the first ``resident_layers`` blocks on the device (the fixed-count option)."""
    if resident_layers > num_blocks:
        raise OffloadError(
            f"offload.resident_layers={resident_layers} exceeds the model's {num_blocks} blocks; "
            f"use at most {num_blocks} (or run without --offload)"
        )
    mode = "resident_layers" if resident_layers else "none"
    return Residency(mode, tuple(range(resident_layers)))


def budget_residency(
    block_bytes: Sequence[int],
    *,
    budget_bytes: int,
    fixed_bytes: int,
    activation_reserve_bytes: int,
    slots: int = 2,
    slot_extra_bytes: int = 0,
) -> Residency:
    """Keep as many block bytes resident as fit in the budget: the largest blocks first,
    spread evenly among their kind.

    The budget pays first for the always-resident modules (``fixed_bytes``), the activation
    reserve and ``slots`` slots of the largest block (each with ``slot_extra_bytes`` more: a
    decoded region, ``slot_dequant``); what is left holds resident blocks. Larger blocks go
    first: every block of a step attends over the same tokens, so a block's compute grows
    more slowly than its bytes and the largest blocks are the most copy-bound (Flux's double
    blocks near the balance point copy for 12.8 ms and compute for ~7.4, its singles the
    other way round; keeping doubles removes the copies the step waits for, keeping singles
    removes copies the stream had time for). Where every block is copy-bound, any kept byte
    saves the same. Within a kind (blocks within 10% of its largest) the kept ones are
    spread evenly, not taken from the front: while a resident block computes, the copy
    stream keeps loading the next streamed one, and a run of resident blocks would leave it
    idle (docs/offload.md, "How many slots").
    """
    largest = max(block_bytes, default=0) + slot_extra_bytes
    minimum = fixed_bytes + activation_reserve_bytes + slots * largest
    if budget_bytes < minimum:
        raise OffloadError(
            f"offload.hbm_budget_gib={budget_bytes / GIB:.2f} is below the "
            f"{minimum / GIB:.2f} GiB needed for the resident modules "
            f"({fixed_bytes / GIB:.2f}), the activation reserve "
            f"({activation_reserve_bytes / GIB:.2f}) and {slots} slots "
            f"({slots * largest / GIB:.2f}); "
            "raise the budget or use --dlo-resident-layers"
        )
    left = budget_bytes - minimum
    resident: list[int] = []
    for kind in _block_kinds(block_bytes):
        # as many as fit taking the largest first; any that many of the kind fit as well
        for i in _spread(kind, _how_many_fit(kind, block_bytes, left)):
            resident.append(i)
            left -= block_bytes[i]
    # Rounding can leave room for a few more whole blocks: fill it front to back.
    for i, size in enumerate(block_bytes):
        if i not in resident and size <= left:
            resident.append(i)
            left -= size
    return Residency("hbm_budget", tuple(sorted(resident)), budget_bytes, activation_reserve_bytes)


def _block_kinds(block_bytes: Sequence[int]) -> list[list[int]]:
    """Block indices grouped by size, largest kind first (a kind: within 10% of its largest)."""
    kinds: list[list[int]] = []
    for i in sorted(range(len(block_bytes)), key=lambda i: (-block_bytes[i], i)):
        if kinds and block_bytes[i] >= 0.9 * block_bytes[kinds[-1][0]]:
            kinds[-1].append(i)
        else:
            kinds.append([i])
    return [sorted(kind) for kind in kinds]


def _how_many_fit(kind: list[int], block_bytes: Sequence[int], left: int) -> int:
    """How many of ``kind``'s blocks ``left`` bytes hold, counting the largest first."""
    count = 0
    for size in sorted((block_bytes[i] for i in kind), reverse=True):
        if size > left:
            break
        left -= size
        count += 1
    return count


def _spread(kind: list[int], count: int) -> list[int]:
    """``count`` of ``kind``'s blocks (in block order), evenly spaced along it."""
    if count <= 0:
        return []
    return [kind[(2 * j + 1) * len(kind) // (2 * count)] for j in range(count)]


@dataclass(frozen=True)
class OffloadPlan:
    """Every block's layout, which of them stream (in call order), and the slot size."""

    blocks: tuple[BlockLayout, ...]
    residency: Residency
    resident_module_bytes: int

    @property
    def streamed(self) -> tuple[int, ...]:
        keep = set(self.residency.resident)
        return tuple(b.index for b in self.blocks if b.index not in keep)

    @property
    def streamed_blocks(self) -> tuple[BlockLayout, ...]:
        return tuple(self.blocks[i] for i in self.streamed)

    @property
    def slot(self) -> SlotLayout:
        return slot_layout(self.streamed_blocks)

    @property
    def streamed_bytes(self) -> int:
        return sum(b.nbytes for b in self.streamed_blocks)

    @property
    def resident_block_bytes(self) -> int:
        return sum(self.blocks[i].payload_bytes for i in self.residency.resident)


def build_plan(
    blocks: Sequence[tuple[str, Sequence[TensorSpec]]],
    *,
    resident_layers: int = 0,
    hbm_budget_bytes: int | None = None,
    resident_module_bytes: int = 0,
    activation_reserve_bytes: int = 0,
    shard_multiple: int = 1,
    slots: int = 2,
    slot_extra_bytes: int = 0,
) -> OffloadPlan:
    """Lay out every block and choose the resident ones (fixed count or HBM budget).
    ``slot_extra_bytes``: device bytes each slot holds beyond the blocks' layout (a decoded
    region), which the budget pays for with the slots."""
    if resident_layers and hbm_budget_bytes is not None:
        raise OffloadError(
            "offload.resident_layers and offload.hbm_budget_gib both choose the resident "
            "blocks; set only one"
        )
    layouts = tuple(
        layout_block(i, name, specs, shard_multiple=shard_multiple)
        for i, (name, specs) in enumerate(blocks)
    )
    if hbm_budget_bytes is None:
        residency = leading_residency(len(layouts), resident_layers)
    else:
        residency = budget_residency(
            [b.nbytes for b in layouts],
            budget_bytes=hbm_budget_bytes,
            fixed_bytes=resident_module_bytes,
            activation_reserve_bytes=activation_reserve_bytes,
            slots=slots,
            slot_extra_bytes=slot_extra_bytes,
        )
    return OffloadPlan(layouts, residency, resident_module_bytes)
