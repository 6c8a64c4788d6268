"""Reading safetensors headers without torch, and the serving dtype a checkpoint is stored in.

Pure (struct and json): ``st_format`` (writing and validating entries) re-exports
``read_header``; ``stored_dtype`` is the default ``--dtype`` rule of ``cachectl build`` and of
the engine's options (``engine.config.checkpoint_dtype``), which the operator imports too.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class HeaderTensor:
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, HeaderTensor], dict[str, str], int]:
    """Parse a shard's header: (tensors, metadata, expected file size). Raises ValueError."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError("file shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", raw_len)
        if length > MAX_HEADER:
            raise ValueError(f"header length {length} is implausible")
        body = f.read(length)
    if len(body) != length:
        raise ValueError("file ends inside the header")
    try:
        header = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + length
    tensors: dict[str, HeaderTensor] = {}
    end = 0
    for name, info in header.items():
        try:
            begin, stop = (int(x) for x in info["data_offsets"])
            tensors[name] = HeaderTensor(str(info["dtype"]), tuple(int(s) for s in info["shape"]),
                                         base + begin, stop - begin)
            end = max(end, stop)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad header record for tensor {name!r}") from e
    return tensors, metadata, base + end


# The floating types a checkpoint is served in, by safetensors name.
SERVING_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def stored_dtype(paths: Sequence[Path]) -> str | None:
    """The serving dtype a checkpoint is stored in: of the ``.safetensors`` among ``paths``,
    the floating type (float32, bfloat16, float16) holding the most bytes; None if none.

    The one rule behind the default ``--dtype`` of both ``cachectl build`` and ``ditserve
    serve``, so an entry built without the flag is the one an engine started without it finds.
    Raises ValueError for an unreadable header.
    """
    totals: dict[str, int] = {}
    for path in paths:
        if path.suffix != ".safetensors":
            continue
        tensors, _, _ = read_header(path)
        for tensor in tensors.values():
            kind = SERVING_DTYPES.get(tensor.dtype)
            if kind is not None:
                totals[kind] = totals.get(kind, 0) + tensor.nbytes
    return max(totals, key=lambda kind: totals[kind]) if totals else None
