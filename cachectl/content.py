"""Do tensors in hand hold exactly an entry's content? The check before a join after a load.

An entry is keyed on its inputs (model digest, loader version, dtype, ...), but the tensors'
final bytes are what counts: a process that loaded the model itself joins an existing entry
only if every tensor's name, dtype, shape and piece-wise digest, and so the content digest,
match the manifest. Otherwise it keeps its own tensors (ContentMismatchError names the
differing ones). Hashing runs on every core. Called by ``CacheStore.ensure`` (``expected``),
that is by ``publish`` and by the engine after an ordinary load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.cachectl.digests import content_digest, tensor_digests
from ditserve.cachectl.errors import ContentMismatchError
from ditserve.cachectl.manifest import Manifest


def differing_tensors(manifest: Manifest, tensors: Mapping[str, Any], *,
                      threads: int | None = None) -> list[str]:
    """Names whose dtype, shape or bytes differ from the manifest, or that only one side has."""
    mine = tensor_digests(tensors, piece_bytes=manifest.piece_bytes, threads=threads)
    theirs = {t.name: (t.dtype, t.shape, t.sha256) for t in manifest.tensors}
    differing = sorted(n for n in mine.keys() | theirs.keys() if mine.get(n) != theirs.get(n))
    rows = [(n, d, s, h) for n, (d, s, h) in mine.items()]
    if not differing and content_digest(rows, manifest.metadata,
                                        manifest.piece_bytes) != manifest.content_digest:
        differing = ["(metadata)"]  # same tensors; cannot happen for a valid manifest
    return differing


def check_tensors_match(manifest: Manifest, tensors: Mapping[str, Any], *,
                        threads: int | None = None) -> None:
    """Raise ContentMismatchError unless ``tensors`` are exactly the entry's content."""
    differing = differing_tensors(manifest, tensors, threads=threads)
    if differing:
        raise ContentMismatchError(manifest.key, differing)
