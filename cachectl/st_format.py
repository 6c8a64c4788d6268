"""The safetensors file format, as the cache writes and checks it.

Owns the header layout, streaming shard writing (header, then each tensor's bytes straight
from its buffer) and header parsing for validation. Files are standard safetensors:
``safetensors.safe_open`` / ``load_file`` read them and keep the mmap. Tensors come as torch tensors or numpy arrays; torch is only
touched when a torch tensor is given (tests and light tools can use numpy).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditserve.cachectl.errors import CacheError
from ditserve.cachectl.st_header import HeaderTensor, read_header

__all__ = ["HeaderTensor", "read_header"]  # header reading lives in st_header (torch-free)

ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
_TORCH_NAMES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fn": "F8_E4M3", "int16": "I16", "uint16": "U16", "float16": "F16",
    "bfloat16": "BF16", "int32": "I32", "uint32": "U32", "float32": "F32", "int64": "I64",
    "uint64": "U64", "float64": "F64",
}
_NUMPY_NAMES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16",
                "float16": "F16", "int32": "I32", "uint32": "U32", "float32": "F32",
                "int64": "I64", "uint64": "U64", "float64": "F64"}
WRITE_CHUNK = 16 * 2**20
# The data section starts at a multiple of this (the header is padded to it). Tensors are
# written largest element first and real DiT tensors are multiples of 64 bytes, so their
# mapped views land 64-byte aligned, as the allocator's own tensors are: CPU matmul kernels
# take another path for a less aligned pointer, so a mapped DiT would differ from a loaded
# one in the last bit (and a device copy from an aligned source is no slower).
DATA_ALIGNMENT = 64


@dataclass(frozen=True)
class RawTensor:
    """A tensor as bytes: safetensors dtype name, shape and a flat byte view."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def as_raw(value: Any) -> RawTensor:
    """Flatten a torch tensor or numpy array into a byte view without copying when contiguous."""
    module = type(value).__module__
    if module.startswith("torch"):
        import torch  # only when the caller handed torch tensors

        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _TORCH_NAMES:
            raise CacheError(f"tensor dtype {t.dtype} cannot be stored in safetensors")
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        return RawTensor(_TORCH_NAMES[name], tuple(t.shape), flat.numpy().data)
    import numpy as np

    a = np.ascontiguousarray(value)
    if a.dtype.name not in _NUMPY_NAMES:
        raise CacheError(f"array dtype {a.dtype} cannot be stored in safetensors")
    return RawTensor(_NUMPY_NAMES[a.dtype.name], tuple(a.shape),
                     a.reshape(-1).view(np.uint8).data)


def header_bytes(entries: Sequence[tuple[str, RawTensor]], metadata: Mapping[str, str]) -> bytes:
    """The safetensors header of a shard holding ``entries`` back to back, in this order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, raw in entries:
        header[name] = {"dtype": raw.dtype, "shape": list(raw.shape),
                        "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Pad with spaces so the data section starts DATA_ALIGNMENT-aligned (a multiple of every
    # element size; see DATA_ALIGNMENT); the 8 bytes of the length come first.
    body += b" " * (-(8 + len(body)) % DATA_ALIGNMENT)
    return struct.pack("<Q", len(body)) + body


def order_for_alignment(names: Sequence[str], raws: Mapping[str, RawTensor]) -> list[str]:
    """Largest element size first, then by name: each tensor starts aligned to its itemsize."""
    return sorted(names, key=lambda n: (-ITEMSIZE[raws[n].dtype], n))


def write_shard(
    path: Path,
    head: bytes,
    entries: Sequence[tuple[str, RawTensor]],
    *,
    on_bytes: Callable[[int], None] | None = None,
) -> int:
    """Write one safetensors file (``head``, then each tensor's bytes streamed from its buffer:
    no second in-memory copy of a multi-GB state dict); returns the file size."""
    size = len(head)
    # O_EXCL: a temp directory is private to this writer; a collision means a bug, not a retry.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
    with os.fdopen(fd, "wb", buffering=0) as f:
        f.write(head)
        for _name, raw in entries:
            data = raw.data.cast("B") if raw.data.format != "B" else raw.data
            for start in range(0, raw.nbytes, WRITE_CHUNK):
                view = data[start:start + WRITE_CHUNK]
                n = view.nbytes
                while view.nbytes:  # a raw write may be partial
                    view = view[f.write(view):]
                if on_bytes is not None:
                    on_bytes(n)
            size += raw.nbytes
    return size
