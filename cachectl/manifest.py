"""The entry manifest: its dataclasses, JSON form and structural validation (schema 2).

``manifest.json`` lists every file (size, header digest, file digest) and tensor (name, dtype,
shape, file, offset, size, piece digests, tensor digest) of an entry, the identity it was built
for, the content digest and a digest of the manifest itself (see ``digests.py`` for the
chain). ``Manifest.from_json`` rejects anything inconsistent without reading any data: file
names that could escape the entry directory, tensors that do not tile their file, any digest
that does not follow from the level below. Verify then recomputes the chain from the bytes.
Called by the publisher (to write it) and the verifier (to check entries before use).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ditserve.cachectl.digests import content_digest, file_digest, manifest_digest, over_pieces
from ditserve.cachectl.errors import OUTDATED, ManifestError
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
    sha256: str  # digests.file_digest
    header_sha256: str  # over the pieces of the bytes before the first tensor


@dataclass(frozen=True)
class TensorRecord:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int  # absolute byte offset of the data in the file
    nbytes: int
    sha256: str  # over_pieces(pieces)
    pieces: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    key: str
    identity: dict[str, Any]
    piece_bytes: int
    files: tuple[FileRecord, ...]
    tensors: tuple[TensorRecord, ...]
    metadata: dict[str, str]
    total_bytes: int
    content_digest: str
    created_at: str
    writer: dict[str, Any]
    schema: int = SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "schema": self.schema,
            "key": self.key,
            "identity": self.identity,
            "piece_bytes": self.piece_bytes,
            "files": [{"name": f.name, "size": f.size, "sha256": f.sha256,
                       "header_sha256": f.header_sha256} for f in self.files],
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                         "file": t.file, "offset": t.offset, "nbytes": t.nbytes,
                         "sha256": t.sha256, "pieces": list(t.pieces)} for t in self.tensors],
            "metadata": self.metadata,
            "total_bytes": self.total_bytes,
            "content_digest": self.content_digest,
            "created_at": self.created_at,
            "writer": self.writer,
        }
        body["manifest_digest"] = manifest_digest(body)
        return body

    def tensors_of(self, file: str) -> list[TensorRecord]:
        """The tensors of one shard in file order."""
        return sorted((t for t in self.tensors if t.file == file), key=lambda t: t.offset)

    def header_length(self, file: FileRecord) -> int:
        """Bytes before the first tensor (the whole file for a shard without tensors)."""
        first = self.tensors_of(file.name)
        return first[0].offset if first else file.size

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Parse and cross-check a manifest; any inconsistency raises ManifestError."""
        if not isinstance(data, dict):
            raise ManifestError("manifest is not a JSON object")
        _check_schema(data.get("schema"))
        try:
            m = cls(
                schema=int(data["schema"]),
                key=str(data["key"]),
                identity=dict(data["identity"]),
                piece_bytes=int(data["piece_bytes"]),
                files=tuple(FileRecord(check_file_name(f["name"]), int(f["size"]),
                                       str(f["sha256"]), str(f["header_sha256"]))
                            for f in data["files"]),
                tensors=tuple(TensorRecord(str(t["name"]), str(t["dtype"]),
                                           tuple(int(s) for s in t["shape"]),
                                           check_file_name(t["file"]), int(t["offset"]),
                                           int(t["nbytes"]), str(t["sha256"]),
                                           tuple(str(p) for p in t["pieces"]))
                              for t in data["tensors"]),
                metadata={str(k): str(v) for k, v in dict(data.get("metadata") or {}).items()},
                total_bytes=int(data["total_bytes"]),
                content_digest=str(data["content_digest"]),
                created_at=str(data["created_at"]),
                writer=dict(data.get("writer") or {}),
            )
            recorded = str(data["manifest_digest"])
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"manifest is missing or mistypes a field: {e!r}") from e
        if manifest_digest(data) != recorded:
            raise ManifestError("manifest_digest does not match the manifest (a field was "
                                "edited after publication)")
        m._check()
        return m

    def _check(self) -> None:
        if not is_key(self.key) or sha256_json(self.identity) != self.key:
            raise ManifestError("manifest key is not the SHA-256 of its identity")
        if self.piece_bytes <= 0:
            raise ManifestError("piece_bytes must be positive")
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ManifestError("manifest lists a file twice")
        sizes = {f.name: f.size for f in self.files}
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise ManifestError(f"tensor {t.name!r} listed twice")
            seen.add(t.name)
            self._check_tensor(t, sizes)
        by_file: dict[str, list[TensorRecord]] = defaultdict(list)
        for t in sorted(self.tensors, key=lambda t: t.offset):
            by_file[t.file].append(t)
        for f in self.files:
            self._check_file(f, by_file[f.name])
        if sum(t.nbytes for t in self.tensors) != self.total_bytes:
            raise ManifestError("total_bytes is not the sum of the tensor sizes")
        rows = [(t.name, t.dtype, t.shape, t.sha256) for t in self.tensors]
        if content_digest(rows, self.metadata, self.piece_bytes) != self.content_digest:
            raise ManifestError("content_digest does not match the tensor records")

    def _check_tensor(self, t: TensorRecord, sizes: dict[str, int]) -> None:
        if t.file not in sizes:
            raise ManifestError(f"tensor {t.name!r} points to unlisted file {t.file!r}")
        if t.dtype not in ITEMSIZE or any(s < 0 for s in t.shape):
            raise ManifestError(f"tensor {t.name!r} has a bad dtype or shape")
        if math.prod(t.shape) * ITEMSIZE[t.dtype] != t.nbytes:
            raise ManifestError(f"tensor {t.name!r}: nbytes does not match dtype x shape")
        if t.offset < 8 or t.offset + t.nbytes > sizes[t.file]:
            raise ManifestError(f"tensor {t.name!r} lies outside its file {t.file!r}")
        if len(t.pieces) != -(-t.nbytes // self.piece_bytes) or not all(map(is_key, t.pieces)):
            raise ManifestError(f"tensor {t.name!r}: piece digests do not cover its bytes")
        if over_pieces([bytes.fromhex(p) for p in t.pieces]) != t.sha256:
            raise ManifestError(f"tensor {t.name!r}: sha256 does not follow from its pieces")

    def _check_file(self, f: FileRecord, tensors: list[TensorRecord]) -> None:
        # Tensors must tile the file after the header: every byte is under exactly one digest.
        end = tensors[0].offset if tensors else f.size
        for t in tensors:
            if t.offset != end:
                raise ManifestError(f"tensors of {f.name!r} leave a gap or overlap at {end}")
            end += t.nbytes
        if end != f.size:
            raise ManifestError(f"tensors of {f.name!r} do not end at its size")
        if not is_key(f.header_sha256):
            raise ManifestError(f"file {f.name!r}: bad header digest")
        if file_digest(f.header_sha256, [t.sha256 for t in tensors]) != f.sha256:
            raise ManifestError(f"file {f.name!r}: sha256 does not follow from its header and "
                                "tensor digests")


def _check_schema(schema: Any) -> None:
    if schema == SCHEMA_VERSION:
        return
    if isinstance(schema, int) and 0 < schema < SCHEMA_VERSION:
        raise ManifestError(
            f"entry written by an older cachectl (manifest schema {schema}; this version reads "
            f"schema {SCHEMA_VERSION}): remove it with `cachectl rm KEY` (or let `cachectl gc` "
            "evict it) and rebuild with `cachectl build --model DIR`; engines build the new "
            "entry under a new key by themselves", kind=OUTDATED)
    raise ManifestError(f"manifest schema {schema!r} is not {SCHEMA_VERSION}: written by a newer "
                        "cachectl? Upgrade this one", kind=OUTDATED)
