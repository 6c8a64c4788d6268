"""The layout of lossless packed bf16 ("12-bit packing"): where every byte of a packed run lies.

Pure (no torch), so the offload plan, the runtime-cache manifest and the AllGather shard
arithmetic can size and place packed bytes from metadata alone. ``packed_encode`` writes this
layout, ``packed_decode`` (CPU) and ``packed_triton`` (GPU) read it.

A packed run is the bf16 values ``[0, numel)`` of one contiguous bf16 region (a streamed
block's bf16 region: the slab unit DLO moves in one copy). Each value's 16 bits are split into

- a **sign+mantissa byte**: bit 7 = sign, bits 0-6 = the 7 mantissa bits;
- a **4-bit exponent code**: an index into a 15-entry table of the 8-bit exponents most used
  in its *group* (``tiles_per_group * tile`` consecutive values); code 15 = escape: the
  exponent is stored verbatim in the stripe's escape list, in position order.

So a value costs 12 bits plus its share of the tables and escapes: ~0.75 of the bf16 bytes.

**Stripes make shards meaningful.** The values are split into ``stripes`` equal runs of
``stripe_numel`` values (a whole number of tiles; values past ``numel`` are zero padding that
is encoded but never written back). Every stripe is packed into a record of the same
``stripe_bytes`` (the escape section is sized to the stripe with the most escapes), so the
packed buffer is ``stripes`` records back to back and, for any group size ``g`` dividing
``stripes``, rank ``r``'s 1/g byte range is exactly stripes ``[r*s/g, (r+1)*s/g)``:
``all_gather_into_tensor`` of those ranges rebuilds the whole buffer, which is then decoded.

Record of one stripe (offsets relative to the record; every section 16-byte aligned, the record
``RECORD_ALIGN``-aligned so each rank's shard starts as a fresh allocation would):

=================  =====================================  =========================
section            content                                size (bytes)
=================  =====================================  =========================
sign_mantissa      uint8 per value                        stripe_numel
codes              uint8, two codes (low nibble = even)   stripe_numel / 2
tables             uint8[16] per group (entry 15 unused)  16 * groups_per_stripe
escape_starts      int32 per tile: first escape's index   4 * tiles_per_stripe
escapes            uint8 exponent per escaped value       escape_capacity
=================  =====================================  =========================

``escape_starts`` lets a decoder handle one tile alone: the k-th escape of tile t (in
position order) is ``escapes[escape_starts[t] + k]`` (the GPU kernel gets k from a prefix sum
over the tile's codes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ditserve.engine.errors import FormatError

if TYPE_CHECKING:
    import torch

FORMAT = "bf16-packed12"
FORMAT_VERSION = 1
ESCAPE = 15  # the code of a value whose exponent is in the escape list
TABLE_ENTRIES = 16  # bytes per group table: 15 exponents + one unused byte
SECTION_ALIGN = 16
RECORD_ALIGN = 256  # the offload plan's ALIGN_BYTES: a shard starts like a cudaMalloc'd tensor
DEFAULT_TILE = 4096
DEFAULT_TILES_PER_GROUP = 16
# 8 stripes: shards for every group size of 1, 2, 4 or 8 ranks (one H200 node).
DEFAULT_STRIPES = 8


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class PackedLayout:
    """Metadata of one packed run; with the packed bytes it is everything a decoder needs.

    JSON-able (``to_dict``/``from_dict``) so a runtime-cache manifest can carry it beside the
    packed bytes. ``escape_counts`` are per stripe (reports, and the escape-rate benchmark).
    """

    numel: int
    stripes: int
    stripe_numel: int
    tile: int
    tiles_per_group: int
    escape_capacity: int
    escape_counts: tuple[int, ...]
    format: str = FORMAT
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.format != FORMAT or self.version != FORMAT_VERSION:
            raise FormatError(
                f"packed layout {self.format!r} v{self.version} is not {FORMAT!r} "
                f"v{FORMAT_VERSION}; rebuild the packed weights (or the cache entry) with "
                "this version of ditserve"
            )
        if self.stripes < 1 or self.tiles_per_group < 1:
            raise FormatError(f"stripes and tiles_per_group must be >= 1, got {self.stripes} "
                              f"and {self.tiles_per_group}")
        if self.tile < 2 or self.tile & (self.tile - 1):
            raise FormatError(f"tile must be a power of two >= 2, got {self.tile}")
        if self.stripe_numel % self.tile or self.stripe_numel * self.stripes < self.numel:
            raise FormatError(
                f"{self.stripes} stripes of {self.stripe_numel} values do not cover "
                f"{self.numel} values in whole tiles of {self.tile}"
            )
        if len(self.escape_counts) != self.stripes or max(self.escape_counts) > (
            self.escape_capacity
        ):
            raise FormatError("escape counts do not fit the layout's escape capacity")

    # -- sizes ---------------------------------------------------------------------------
    @property
    def tiles_per_stripe(self) -> int:
        return self.stripe_numel // self.tile

    @property
    def groups_per_stripe(self) -> int:
        return -(-self.tiles_per_stripe // self.tiles_per_group)

    @property
    def sign_mantissa_offset(self) -> int:
        return 0

    @property
    def codes_offset(self) -> int:
        return _round_up(self.stripe_numel, SECTION_ALIGN)

    @property
    def tables_offset(self) -> int:
        return self.codes_offset + _round_up(self.stripe_numel // 2, SECTION_ALIGN)

    @property
    def escape_starts_offset(self) -> int:
        return self.tables_offset + TABLE_ENTRIES * self.groups_per_stripe

    @property
    def escapes_offset(self) -> int:
        return self.escape_starts_offset + _round_up(4 * self.tiles_per_stripe, SECTION_ALIGN)

    @property
    def stripe_bytes(self) -> int:
        return _round_up(self.escapes_offset + self.escape_capacity, RECORD_ALIGN)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed buffer (what the host stores and one load moves)."""
        return self.stripes * self.stripe_bytes

    @property
    def raw_nbytes(self) -> int:
        return 2 * self.numel

    @property
    def ratio(self) -> float:
        """Packed bytes over bf16 bytes (~0.75 for weights)."""
        return self.nbytes / max(1, self.raw_nbytes)

    @property
    def escapes(self) -> int:
        return sum(self.escape_counts)

    # -- shards --------------------------------------------------------------------------
    def shard_range(self, rank: int, group_size: int) -> tuple[int, int]:
        """Byte range ``[start, stop)`` of the packed buffer that ``rank`` of ``group_size``
        holds; the group's ranges, gathered in rank order, are the whole buffer."""
        if group_size < 1 or not 0 <= rank < group_size:
            raise FormatError(f"rank {rank} is outside a group of {group_size}")
        if self.stripes % group_size:
            raise FormatError(
                f"a run packed in {self.stripes} stripes cannot be split over {group_size} "
                f"ranks; pack it with stripes a multiple of {group_size}"
            )
        share = self.nbytes // group_size
        return rank * share, (rank + 1) * share

    # -- persistence ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["escape_counts"] = list(self.escape_counts)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> PackedLayout:
        try:
            counts = tuple(int(c) for c in data["escape_counts"])  # type: ignore[attr-defined]
            return cls(
                numel=int(data["numel"]),  # type: ignore[call-overload]
                stripes=int(data["stripes"]),  # type: ignore[call-overload]
                stripe_numel=int(data["stripe_numel"]),  # type: ignore[call-overload]
                tile=int(data["tile"]),  # type: ignore[call-overload]
                tiles_per_group=int(data["tiles_per_group"]),  # type: ignore[call-overload]
                escape_capacity=int(data["escape_capacity"]),  # type: ignore[call-overload]
                escape_counts=counts,
                format=str(data.get("format", "")),
                version=int(data.get("version", 0)),  # type: ignore[call-overload]
            )
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError(f"not a packed bf16 layout: {e}") from e


def plan_stripes(numel: int, *, stripes: int, tile: int) -> int:
    """Values per stripe: the fewest whole tiles such that ``stripes`` of them cover numel."""
    if stripes < 1:
        raise FormatError(f"stripes must be >= 1, got {stripes}")
    if numel < 0:
        raise FormatError(f"numel must be >= 0, got {numel}")
    per_stripe = -(-numel // stripes)
    return max(tile, _round_up(per_stripe, tile))


def layout_for(
    numel: int,
    escape_counts: tuple[int, ...],
    *,
    stripes: int = DEFAULT_STRIPES,
    tile: int = DEFAULT_TILE,
    tiles_per_group: int = DEFAULT_TILES_PER_GROUP,
) -> PackedLayout:
    """The layout of ``numel`` values with the given per-stripe escape counts."""
    stripe_numel = plan_stripes(numel, stripes=stripes, tile=tile)
    capacity = _round_up(max(escape_counts, default=0), SECTION_ALIGN)
    return PackedLayout(numel, stripes, stripe_numel, tile, tiles_per_group, capacity,
                        tuple(escape_counts))


@dataclass(frozen=True)
class PackedBf16:
    """A packed run: its layout and its bytes (a flat uint8 tensor of ``layout.nbytes``).

    ``data`` may live anywhere a uint8 tensor can: a pinned host slab (copy source), a device
    staging slot (decode source), a runtime-cache mmap. Decoders never modify it.
    """

    layout: PackedLayout
    data: torch.Tensor

    def __post_init__(self) -> None:
        import torch

        if self.data.dtype != torch.uint8 or self.data.dim() != 1:
            raise FormatError(f"packed bytes must be a flat uint8 tensor, got "
                              f"{self.data.dtype} of shape {tuple(self.data.shape)}")
        if self.data.numel() != self.layout.nbytes:
            raise FormatError(f"packed buffer holds {self.data.numel()} bytes; its layout "
                              f"needs {self.layout.nbytes}")

    def shard(self, rank: int, group_size: int) -> torch.Tensor:
        """The bytes ``rank`` keeps (a view): its input to ``all_gather_into_tensor``."""
        start, stop = self.layout.shard_range(rank, group_size)
        return self.data[start:stop]

    def with_data(self, data: torch.Tensor) -> PackedBf16:
        """The same layout over other bytes (e.g. the copy in a device slot)."""
        return PackedBf16(self.layout, data)
