"""HTTP Range requests on a file of known size (RFC 9110, section 14), one range at a time.

``choose_range(header, size, if_range=, etag=)`` says what to send: the whole file (no
Range, a Range we do not understand, several ranges, or an If-Range that no longer matches:
RFC 9110 lets a server ignore such a Range and answer 200), one ``(start, end)`` slice
(206), or ``Unsatisfiable`` (416: the first byte asked for is past the end). Called by the
video content route; pure, so its cases are tested without a server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RANGE = re.compile(r"^\s*bytes\s*=\s*([0-9]{0,19})\s*-\s*([0-9]{0,19})\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Unsatisfiable:
    """No byte of the range exists (answer 416 with ``Content-Range: bytes */size``)."""

    size: int


def choose_range(header: str | None, size: int, *, if_range: str | None = None,
                 etag: str | None = None) -> tuple[int, int] | Unsatisfiable | None:
    """None: send everything. (start, end): send bytes start..end-1 (end exclusive)."""
    if header is None or (if_range is not None and if_range.strip() != etag):
        return None
    match = _RANGE.match(header)
    if match is None:  # several ranges, another unit, or not a range at all
        return None
    first, last = match.group(1), match.group(2)
    if not first and not last:
        return None
    if not first:  # "-N": the last N bytes
        suffix = int(last)
        if suffix == 0 or size == 0:
            return Unsatisfiable(size)
        return max(0, size - suffix), size
    start = int(first)
    end = size if not last else min(int(last) + 1, size)
    if last and int(last) < start:
        return None  # an invalid range is ignored, not refused
    if start >= size:
        return Unsatisfiable(size)
    return start, end
