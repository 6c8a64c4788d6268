"""CPU encoder of lossless packed bf16 (layout: ``packed_layout``).

Runs at load time over every streamed block's bf16 region (~24 GB for a Flux-sized DiT), so it
is vectorized torch on uint8 byte planes, one stripe at a time (temporaries stay a few bytes
per value of one stripe, never of the whole model). The same ops run on whatever device the
values are on: on a CPU it packs ~0.12 GB/s per core (docs/formats.md); given the block on a CUDA device
(the loader uploads it anyway) it packs at device speed and only the packed bytes come back to
the host buffer. Both produce the same bytes. ``bench/codec.py`` measures both.

Called by the offload's packed backing (``offload.host.packed_slabs``: each streamed block at
enable, on the offload device), tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ditserve.engine.errors import FormatError
from ditserve.engine.formats.packed_layout import (
    DEFAULT_STRIPES,
    DEFAULT_TILE,
    DEFAULT_TILES_PER_GROUP,
    ESCAPE,
    TABLE_ENTRIES,
    PackedBf16,
    PackedLayout,
    layout_for,
    plan_stripes,
)

Allocator = Callable[[int], torch.Tensor]  # nbytes -> flat uint8 tensor (e.g. pinned)
_TABLE_SIZE = ESCAPE  # 15 exponents per group table
CPU_CHUNK_VALUES = 1 << 19  # 8 groups of 64K values: measured best with 256K-1M
# Ranks exponents by count, ties to the smaller exponent: tables (and so the packed bytes, and
# a cache entry's digest) are the same on every machine and device.
_TIE_BREAK = 255 - torch.arange(256, dtype=torch.int64)


@dataclass
class _Stripe:
    sign_mantissa: torch.Tensor  # uint8 (S,)
    codes: torch.Tensor  # uint8 (S/2,)
    tables: torch.Tensor  # uint8 (G, 16)
    escape_starts: torch.Tensor  # int32 (T,)
    escapes: torch.Tensor  # uint8 (E,)


def _default_allocator(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _byte_planes(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sign+mantissa, exponent) bytes of bf16 values given as their raw little-endian bytes."""
    lo, hi = chunk[0::2], chunk[1::2]  # bf16 bits 0-7 and 8-15
    sign_mantissa = (hi & 0x80) | (lo & 0x7F)
    exponent = ((hi & 0x7F) << 1) | (lo >> 7)
    return sign_mantissa, exponent


def _encode_stripe(raw: torch.Tensor, *, tile: int, tiles_per_group: int,
                   chunk_tiles: int) -> _Stripe:
    """Pack one stripe: ``raw`` holds its values' bytes (2 per value, zero padded to tiles).

    Works through the stripe ``chunk_tiles`` tiles (whole groups) at a time: on a CPU, chunks
    of ~0.5M values keep the int32 temporaries in cache (1.6x faster than whole stripes)."""
    device = raw.device
    numel = raw.numel() // 2
    tiles = numel // tile
    groups = -(-tiles // tiles_per_group)
    chunk_tiles = max(tiles_per_group, chunk_tiles // tiles_per_group * tiles_per_group)
    # Group index (within a chunk) * 256 per tile: + exponent = that value's histogram bin.
    tile_base = ((torch.arange(chunk_tiles, dtype=torch.int32, device=device)
                  // tiles_per_group) * 256).unsqueeze(1)
    tie_break = _TIE_BREAK.to(device)
    code_of = torch.arange(_TABLE_SIZE, dtype=torch.uint8, device=device)
    sign_mantissa = torch.empty(numel, dtype=torch.uint8, device=device)
    codes = torch.empty(numel // 2, dtype=torch.uint8, device=device)
    tables = torch.zeros(groups, TABLE_ENTRIES, dtype=torch.uint8, device=device)
    per_tile = torch.empty(tiles, dtype=torch.int64, device=device)
    escapes: list[torch.Tensor] = []
    for t0 in range(0, tiles, chunk_tiles):
        t1 = min(tiles, t0 + chunk_tiles)
        g0, g1 = t0 // tiles_per_group, -(-t1 // tiles_per_group)
        v0, v1 = t0 * tile, t1 * tile
        sm, exponent = _byte_planes(raw[2 * v0 : 2 * v1])
        sign_mantissa[v0:v1] = sm
        # (tiles, tile) uint8 + (tiles, 1) int32 -> (values,) int32 bins; one bincount
        # gives every group's exponent histogram.
        bins = torch.add(exponent.view(-1, tile), tile_base[: t1 - t0]).view(-1)
        counts = torch.bincount(bins, minlength=(g1 - g0) * 256).view(g1 - g0, 256)
        ranked = (counts * 256 + tie_break).topk(_TABLE_SIZE, dim=1).indices  # (G, 15)
        tables[g0:g1, :_TABLE_SIZE] = ranked.to(torch.uint8)
        # exponent -> code per group; exponents outside the table map to the escape code.
        lut = torch.full((g1 - g0, 256), ESCAPE, dtype=torch.uint8, device=device)
        lut.scatter_(1, ranked, code_of.expand(g1 - g0, -1))
        code = lut.view(-1)[bins]
        codes[v0 // 2 : v1 // 2] = code[0::2] | (code[1::2] << 4)
        escaped = code == ESCAPE
        escapes.append(exponent[escaped])
        per_tile[t0:t1] = escaped.view(-1, tile).sum(dim=1)
    escape_starts = (per_tile.cumsum(0) - per_tile).to(torch.int32)
    found = torch.cat(escapes) if escapes else torch.empty(0, dtype=torch.uint8, device=device)
    return _Stripe(sign_mantissa, codes, tables, escape_starts, found)


def encode(
    values: torch.Tensor,
    *,
    stripes: int = DEFAULT_STRIPES,
    tile: int = DEFAULT_TILE,
    tiles_per_group: int = DEFAULT_TILES_PER_GROUP,
    allocate: Allocator | None = None,
) -> PackedBf16:
    """Pack a contiguous bf16 tensor (any shape, read as flat; on a CPU or a CUDA device)
    losslessly.

    ``allocate(nbytes)`` provides the packed buffer (a pinned slab region, say); by default an
    ordinary CPU tensor. Every bit pattern round-trips: zeros of both signs, subnormals,
    infinities, NaNs with their payloads.
    """
    if values.dtype != torch.bfloat16:
        raise FormatError(f"packed bf16 encodes bfloat16 tensors, got {values.dtype}; "
                          "pack only the bf16 region of a block")
    if not values.is_contiguous():
        raise FormatError("encode takes a contiguous tensor (a block's flat bf16 region)")
    numel, device = values.numel(), values.device
    stripe_numel = plan_stripes(numel, stripes=stripes, tile=tile)
    raw = values.reshape(-1).view(torch.uint8)
    # On CUDA one chunk per stripe (fewer launches); on a CPU ~1M values (cache-sized).
    chunk_tiles = (stripe_numel // tile if device.type == "cuda"
                   else max(1, CPU_CHUNK_VALUES // tile))
    parts: list[_Stripe] = []
    for s in range(stripes):
        lo, hi = s * stripe_numel, min((s + 1) * stripe_numel, numel)
        chunk = raw[2 * lo : 2 * hi] if hi > lo else raw[:0]
        if hi - lo < stripe_numel:  # the last stripe(s): zero padding to whole tiles
            padded = torch.zeros(2 * stripe_numel, dtype=torch.uint8, device=device)
            padded[: chunk.numel()] = chunk
            chunk = padded
        parts.append(_encode_stripe(chunk, tile=tile, tiles_per_group=tiles_per_group,
                                    chunk_tiles=chunk_tiles))
    layout = layout_for(numel, tuple(p.escapes.numel() for p in parts), stripes=stripes,
                        tile=tile, tiles_per_group=tiles_per_group)
    data = (allocate or _default_allocator)(layout.nbytes)
    if data.dtype != torch.uint8 or data.numel() != layout.nbytes:
        raise FormatError(f"the allocator returned {data.numel()} {data.dtype} elements; "
                          f"expected {layout.nbytes} uint8")
    _assemble(layout, parts, data)
    return PackedBf16(layout, data)


def _assemble(layout: PackedLayout, parts: list[_Stripe], data: torch.Tensor) -> None:
    """Write every stripe's sections into its record (padding bytes are zeroed: the packed
    bytes of the same weights are the same bytes, so a cache digest over them is stable)."""
    records = data.view(layout.stripes, layout.stripe_bytes)
    records.zero_()
    n = layout.stripe_numel
    for record, part in zip(records, parts, strict=True):
        record[:n] = part.sign_mantissa
        record[layout.codes_offset : layout.codes_offset + n // 2] = part.codes
        tables = part.tables.reshape(-1)
        record[layout.tables_offset : layout.tables_offset + tables.numel()] = tables
        starts = part.escape_starts.view(torch.uint8)  # little-endian int32 bytes
        record[layout.escape_starts_offset : layout.escape_starts_offset + starts.numel()] = (
            starts)
        record[layout.escapes_offset : layout.escapes_offset + part.escapes.numel()] = (
            part.escapes)
