"""The GPU decoder of packed bf16: one Triton kernel, one program per tile.

Each program rebuilds ``tile`` consecutive values: it reads their sign+mantissa bytes and
4-bit codes, looks the codes up in the tile's group table, and takes escaped exponents from
the stripe's escape list at ``escape_starts[tile] + (escapes before the value in the tile)``,
a prefix sum over the tile's codes. So tiles are independent: no second pass, no atomics, no
scratch memory. Output is written as int16 bit patterns through a view of the caller's bf16
tensor, so the result is bit-exact by construction (no float arithmetic anywhere).

Launch contract (what DLO relies on): ``decode_into_cuda`` allocates nothing, never syncs the
host, and runs on the current CUDA stream, so the caller orders it with events like any kernel
(after the packed bytes' copy, before the block's compute). Reads ``packed_layout``; called by
``packed_decode.decode_into``. Triton is imported here only, so CPU-only installs never need it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ditserve.engine.errors import FormatError
from ditserve.engine.formats.packed_layout import PackedBf16


@triton.jit
def _decode_tiles(
    data_ptr,  # uint8: the packed buffer
    words_ptr,  # int32 view of the same buffer (escape_starts)
    out_ptr,  # int16 view of the bf16 output
    numel,
    stripe_bytes,
    stripe_words,
    stripe_numel,
    tiles_per_stripe,
    codes_offset,
    tables_offset,
    starts_word_offset,
    escapes_offset,
    TILE: tl.constexpr,
    TILES_PER_GROUP: tl.constexpr,
):
    pid = tl.program_id(0)
    stripe = pid // tiles_per_stripe
    tile = pid % tiles_per_stripe
    record = data_ptr + stripe.to(tl.int64) * stripe_bytes
    local = tile * TILE + tl.arange(0, TILE)  # value index inside the stripe
    # Padding values of the last stripe are packed too, so these loads stay in the record.
    sign_mantissa = tl.load(record + local).to(tl.int32)
    code_byte = tl.load(record + codes_offset + local // 2).to(tl.int32)
    code = (code_byte >> ((local & 1) * 4)) & 15
    group = tile // TILES_PER_GROUP
    exponent = tl.load(record + tables_offset + group * 16 + code).to(tl.int32)
    escaped = code == 15
    rank = tl.cumsum(escaped.to(tl.int32), axis=0) - 1  # escapes before this one, in the tile
    first = tl.load(words_ptr + stripe.to(tl.int64) * stripe_words + starts_word_offset + tile)
    escaped_exponent = tl.load(record + escapes_offset + first + rank, mask=escaped, other=0)
    exponent = tl.where(escaped, escaped_exponent.to(tl.int32), exponent)
    bits = ((sign_mantissa & 0x80) << 8) | (exponent << 7) | (sign_mantissa & 0x7F)
    index = stripe.to(tl.int64) * stripe_numel + local
    # int32 -> int16 keeps the low 16 bits: the bf16 bit pattern.
    tl.store(out_ptr + index, bits.to(tl.int16), mask=index < numel)


def decode_into_cuda(packed: PackedBf16, out: torch.Tensor, *, num_warps: int = 8) -> None:
    """Launch the decode of ``packed`` into ``out`` (both on one CUDA device; checked by
    ``packed_decode.check_target``) on the current stream."""
    layout, data = packed.layout, packed.data
    if data.storage_offset() % 4:
        raise FormatError("the packed bytes must start 4-byte aligned (the escape starts are "
                          "int32); place them at an aligned offset of the slot")
    words = data.view(torch.int32)
    grid = (layout.stripes * layout.tiles_per_stripe,)
    _decode_tiles[grid](
        data, words, out.view(torch.int16), layout.numel,
        layout.stripe_bytes, layout.stripe_bytes // 4, layout.stripe_numel,
        layout.tiles_per_stripe, layout.codes_offset, layout.tables_offset,
        layout.escape_starts_offset // 4, layout.escapes_offset,
        TILE=layout.tile, TILES_PER_GROUP=layout.tiles_per_group, num_warps=num_warps,
    )
