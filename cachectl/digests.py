"""The digest chain of an entry (manifest schema 2), from pieces up to the content digest.

    piece        SHA-256 of one ``piece_bytes`` slice of a tensor's bytes (or of a header)
    tensor       SHA-256 over its piece digests (32 raw bytes each, in order)
    header       SHA-256 over the header piece digests of a shard (bytes before the first tensor)
    file         SHA-256 over the header digest and the digests of its tensors in file order
    content      SHA-256 of canonical JSON: piece size, metadata, sorted (name, dtype, shape,
                 tensor digest); independent of how tensors are spread over files
    manifest     SHA-256 of the canonical JSON of every other manifest field

Each level is recomputed from the data by verify, so a byte changed together with any one
recorded digest is still caught at the next level. These are hash lists, not ``sha256sum`` of a
file: pieces can be hashed on every core at once. Called by the publisher, the manifest checks,
verify, model source digests and the engine's content check before a join.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ditserve.cachectl.hashing import PIECE_BYTES, hash_buffers
from ditserve.cachectl.identity import sha256_json


def over_pieces(pieces: Sequence[bytes]) -> str:
    """The digest of a range from its piece digests (an empty range: SHA-256 of nothing)."""
    return hashlib.sha256(b"".join(pieces)).hexdigest()


def file_digest(header_sha256: str, tensor_sha256s_in_file_order: Iterable[str]) -> str:
    h = hashlib.sha256(bytes.fromhex(header_sha256))
    for digest in tensor_sha256s_in_file_order:
        h.update(bytes.fromhex(digest))
    return h.hexdigest()


def content_digest(rows: Iterable[tuple[str, str, Sequence[int], str]],
                   metadata: Mapping[str, str], piece_bytes: int) -> str:
    """Layout-independent digest over (name, dtype, shape, tensor digest) rows and metadata."""
    table = sorted([name, dtype, list(shape), sha] for name, dtype, shape, sha in rows)
    return sha256_json({"piece_bytes": piece_bytes, "metadata": dict(metadata),
                        "tensors": table})


def manifest_digest(fields: Mapping[str, Any]) -> str:
    """The digest of a manifest's JSON form, without its own ``manifest_digest`` field."""
    return sha256_json({k: v for k, v in fields.items() if k != "manifest_digest"})


def tensor_digests(tensors: Mapping[str, Any], *, piece_bytes: int = PIECE_BYTES,
                   threads: int | None = None) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (safetensors dtype, shape, tensor digest) of in-memory torch/numpy tensors."""
    from ditserve.cachectl.st_format import as_raw

    raws = {str(name): as_raw(t) for name, t in tensors.items()}
    pieces = hash_buffers({n: r.data for n, r in raws.items()}, piece_bytes=piece_bytes,
                          threads=threads)
    return {n: (r.dtype, r.shape, over_pieces(pieces[n])) for n, r in raws.items()}
