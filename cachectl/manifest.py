"""The entry manifest: its dataclasses, JSON form, structural validation and content digest.

``manifest.json`` lists every file (size, SHA-256) and tensor (name, dtype, shape, file, offset,
size, SHA-256) of an entry, plus the identity it was built for. ``Manifest.from_json`` rejects
anything inconsistent, including file names that could escape the entry directory. Called by
the publisher (to write it) and the verifier (to check entries before use).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ditserve.cachectl.errors import ManifestError
from ditserve.cachectl.identity import SCHEMA_VERSION, is_key, sha256_json
from ditserve.cachectl.st_format import ITEMSIZE

MANIFEST_NAME = "manifest.json"
# A shard name is one plain path component: no separators, no "..", nothing hidden.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def check_file_name(name: Any) -> str:
    """Return ``name`` if it is a safe shard file name, else raise ManifestError."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or ".." in name:
        raise ManifestError(f"file name {name!r} is not a plain name inside the entry")
    if name == MANIFEST_NAME:
        raise ManifestError("a shard may not be called manifest.json")
    return name


@dataclass(frozen=True)
class FileRecord:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class TensorRecord:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int
    sha256: str


def content_digest(tensors: list[TensorRecord], metadata: Mapping[str, str]) -> str:
    """Layout-independent digest over tensor names, dtypes, shapes, bytes and the metadata."""
    rows = sorted([t.name, t.dtype, list(t.shape), t.sha256] for t in tensors)
    return sha256_json({"metadata": dict(metadata), "tensors": rows})


@dataclass(frozen=True)
class Manifest:
    key: str
    identity: dict[str, Any]
    files: tuple[FileRecord, ...]
    tensors: tuple[TensorRecord, ...]
    metadata: dict[str, str]
    total_bytes: int
    content_digest: str
    created_at: str
    writer: dict[str, Any]
    schema: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "key": self.key,
            "identity": self.identity,
            "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in self.files],
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                         "file": t.file, "offset": t.offset, "nbytes": t.nbytes,
                         "sha256": t.sha256} for t in self.tensors],
            "metadata": self.metadata,
            "total_bytes": self.total_bytes,
            "content_digest": self.content_digest,
            "created_at": self.created_at,
            "writer": self.writer,
        }

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Parse and cross-check a manifest; any inconsistency raises ManifestError."""
        if not isinstance(data, dict):
            raise ManifestError("manifest is not a JSON object")
        try:
            m = cls(
                schema=int(data["schema"]),
                key=str(data["key"]),
                identity=dict(data["identity"]),
                files=tuple(FileRecord(check_file_name(f["name"]), int(f["size"]),
                                       str(f["sha256"])) for f in data["files"]),
                tensors=tuple(TensorRecord(str(t["name"]), str(t["dtype"]),
                                           tuple(int(s) for s in t["shape"]),
                                           check_file_name(t["file"]), int(t["offset"]),
                                           int(t["nbytes"]), str(t["sha256"]))
                              for t in data["tensors"]),
                metadata={str(k): str(v) for k, v in dict(data.get("metadata") or {}).items()},
                total_bytes=int(data["total_bytes"]),
                content_digest=str(data["content_digest"]),
                created_at=str(data["created_at"]),
                writer=dict(data.get("writer") or {}),
            )
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"manifest is missing or mistypes a field: {e!r}") from e
        m._check()
        return m

    def _check(self) -> None:
        if self.schema != SCHEMA_VERSION:
            raise ManifestError(f"manifest schema {self.schema} is not {SCHEMA_VERSION}")
        if not is_key(self.key) or sha256_json(self.identity) != self.key:
            raise ManifestError("manifest key is not the SHA-256 of its identity")
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ManifestError("manifest lists a file twice")
        sizes = {f.name: f.size for f in self.files}
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise ManifestError(f"tensor {t.name!r} listed twice")
            seen.add(t.name)
            if t.file not in sizes:
                raise ManifestError(f"tensor {t.name!r} points to unlisted file {t.file!r}")
            if t.dtype not in ITEMSIZE or any(s < 0 for s in t.shape):
                raise ManifestError(f"tensor {t.name!r} has a bad dtype or shape")
            if math.prod(t.shape) * ITEMSIZE[t.dtype] != t.nbytes:
                raise ManifestError(f"tensor {t.name!r}: nbytes does not match dtype x shape")
            if t.offset < 8 or t.offset + t.nbytes > sizes[t.file]:
                raise ManifestError(f"tensor {t.name!r} lies outside its file {t.file!r}")
        if sum(t.nbytes for t in self.tensors) != self.total_bytes:
            raise ManifestError("total_bytes is not the sum of the tensor sizes")
        if content_digest(list(self.tensors), self.metadata) != self.content_digest:
            raise ManifestError("content_digest does not match the tensor records")
