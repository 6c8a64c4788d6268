"""Decoding packed bf16 into a caller-owned bf16 tensor: CPU here, CUDA through Triton.

``decode_into(packed, out)`` is the one entry point: the packed bytes and ``out`` on the same
device, ``out`` a contiguous bf16 tensor of ``layout.numel`` elements (a device slot's bf16
region, say). On CUDA it launches ``packed_triton``'s kernel on the current stream and returns
at once (no allocation, no host sync); on CPU it decodes stripe by stripe with torch (tests,
CPU DLO). Both write exactly the bits that were encoded.

Called by the offload's decoding transfer (``offload.movement.decode``: after the packed bytes
landed in a slot's staging), the packed backing (blocks given back at disable), tests and
benchmarks.
"""

from __future__ import annotations

import torch

from ditserve.engine.errors import FormatError
from ditserve.engine.formats.packed_layout import ESCAPE, TABLE_ENTRIES, PackedBf16


def check_target(packed: PackedBf16, out: torch.Tensor) -> None:
    """Raise unless ``out`` can receive the decoded values of ``packed``."""
    layout = packed.layout
    if out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise FormatError(f"decode writes a contiguous bfloat16 tensor, got {out.dtype}"
                          f"{'' if out.is_contiguous() else ' (non-contiguous)'}")
    if out.numel() != layout.numel:
        raise FormatError(f"the target holds {out.numel()} values; the packed run has "
                          f"{layout.numel}")
    if out.device != packed.data.device:
        raise FormatError(f"packed bytes are on {packed.data.device} but the target is on "
                          f"{out.device}; copy the packed bytes to the target's device first")


def decode_into(packed: PackedBf16, out: torch.Tensor) -> torch.Tensor:
    """Write the values of ``packed`` into ``out`` (see module docstring); returns ``out``."""
    check_target(packed, out)
    return decode_checked(packed, out)


def decode_checked(packed: PackedBf16, out: torch.Tensor) -> torch.Tensor:
    """``decode_into`` for a pair ``check_target`` already accepted: the offload's decoding
    transfer checks each (staging, slot) pair once when it prepares a block's loads, not on
    every load of every step."""
    if packed.layout.numel == 0:
        return out
    if out.device.type == "cuda":
        from ditserve.engine.formats.packed_triton import decode_into_cuda

        decode_into_cuda(packed, out)
    else:
        _decode_cpu(packed, out)
    return out


def decode(packed: PackedBf16) -> torch.Tensor:
    """The values of ``packed`` as a new flat bf16 tensor on the packed bytes' device."""
    out = torch.empty(packed.layout.numel, dtype=torch.bfloat16, device=packed.data.device)
    return decode_into(packed, out)


def _decode_cpu(packed: PackedBf16, out: torch.Tensor) -> None:
    layout = packed.layout
    n = layout.stripe_numel
    group_size = layout.tile * layout.tiles_per_group
    table_index = (torch.arange(n, dtype=torch.int64) // group_size) * TABLE_ENTRIES
    records = packed.data.view(layout.stripes, layout.stripe_bytes)
    out_bytes = out.view(-1).view(torch.uint8)  # 2 bytes per value, little-endian
    for s, record in enumerate(records):
        first = s * n
        count = min(n, layout.numel - first)
        if count <= 0:
            break
        sign_mantissa = record[:n]
        packed_codes = record[layout.codes_offset : layout.codes_offset + n // 2]
        # (S/2,) -> (S/2, 2) -> (S,): the low nibble is the even value's code.
        code = torch.stack((packed_codes & 0x0F, packed_codes >> 4), dim=1).view(-1)
        tables = record[layout.tables_offset :
                        layout.tables_offset + TABLE_ENTRIES * layout.groups_per_stripe]
        exponent = tables[table_index + code]
        escaped = code == ESCAPE
        expected = layout.escape_counts[s]
        found = int(escaped.sum())
        if found != expected:
            raise FormatError(f"stripe {s} has {found} escape codes but its layout records "
                              f"{expected}: the packed bytes are corrupt")
        exponent[escaped] = record[layout.escapes_offset : layout.escapes_offset + expected]
        hi = (sign_mantissa & 0x80) | (exponent >> 1)
        lo = ((exponent & 1) << 7) | (sign_mantissa & 0x7F)
        target = out_bytes[2 * first : 2 * (first + count)]
        target[0::2] = lo[:count]
        target[1::2] = hi[:count]
