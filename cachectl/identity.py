"""Entry identity: what makes two cache entries the same, and the keys derived from it.

Owns the canonical JSON encoding, ``EntryIdentity`` (whose SHA-256 is the entry key), ``Recipe``
(the same fields with a cheap stat fingerprint of the model files instead of their content
digest: the *recipe key*, computable before hashing or loading anything) and ``Placement``
(an engine process's full parallel position, of which only the weight-relevant part enters
the identity). Called by the store, the CLI, the daemon and the engine. Pure Python.

Identity includes: schema version, model identity (source digest, revision), runtime dtype,
loader name / implementation digest / inputs, component names, TP size and rank, SP
implementation and world size. It excludes DP size/rank and the SP rank: DP replicas and SP
ranks hold the same weights, so they share one entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditserve.cachectl.errors import InvalidIdentityError
from ditserve.cachectl.hashing import PIECE_BYTES, Span, hash_spans

# 2: piece digests (parallel verify), manifest digest, mount-path-free recipes. Entries of
# schema 1 get other keys and are refused with a message saying how to rebuild them.
SCHEMA_VERSION = 2
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def canonical_json(value: Any) -> bytes:
    """One byte string per value: sorted keys, no whitespace, UTF-8, no NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def sha256_json(value: Any) -> str:
    return hashlib.sha256(canonical_json(value)).hexdigest()


def is_key(text: str) -> bool:
    """True for a well-formed entry or recipe key (64 lowercase hex digits)."""
    return bool(_HEX64.match(text))


@dataclass(frozen=True)
class Placement:
    """Where one engine process sits in its replica's process grid."""

    dp_size: int = 1
    dp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    sp_size: int = 1
    sp_rank: int = 0
    sp_impl: str | None = None

    def __post_init__(self) -> None:
        for group in ("dp", "tp", "sp"):
            size, rank = getattr(self, f"{group}_size"), getattr(self, f"{group}_rank")
            if not isinstance(size, int) or size < 1:
                raise InvalidIdentityError(f"{group}_size must be an integer >= 1, got {size!r}")
            if not isinstance(rank, int) or not 0 <= rank < size:
                raise InvalidIdentityError(
                    f"{group}_rank must be in [0, {group}_size={size}), got {rank!r}")


@dataclass(frozen=True)
class _Common:
    """Fields shared by a recipe and the identity it resolves to."""

    revision: str | None
    dtype: str
    loader: str
    loader_version: str
    loader_inputs: tuple[tuple[str, str], ...] = ()
    components: tuple[str, ...] = ("transformer",)
    tp_size: int = 1
    tp_rank: int = 0
    sp_impl: str | None = None
    sp_size: int = 1
    schema: int = SCHEMA_VERSION

    def _check(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidIdentityError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not self.loader or not self.loader_version:
            raise InvalidIdentityError("loader and loader_version must be non-empty strings")
        if not self.components or any(not c for c in self.components):
            raise InvalidIdentityError("components must be a non-empty list of names")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidIdentityError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if self.sp_size < 1:
            raise InvalidIdentityError(f"sp_size must be >= 1, got {self.sp_size}")

    def _body(self, model: dict[str, Any]) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "model": model,
            "dtype": self.dtype,
            "loader": {"name": self.loader, "version": self.loader_version,
                       "inputs": dict(self.loader_inputs)},
            "components": list(self.components),
            "parallel": {"tp_size": self.tp_size, "tp_rank": self.tp_rank,
                         "sp_impl": self.sp_impl, "sp_size": self.sp_size},
        }


@dataclass(frozen=True)
class EntryIdentity(_Common):
    """The identity of one entry; ``key`` = SHA-256 of its canonical JSON."""

    model_digest: str = field(default="", kw_only=True)

    def __post_init__(self) -> None:
        self._check()
        if not is_key(self.model_digest):
            raise InvalidIdentityError("model_digest must be 64 lowercase hex digits (a SHA-256)")

    def to_json(self) -> dict[str, Any]:
        return self._body({"digest": self.model_digest, "revision": self.revision})

    @property
    def key(self) -> str:
        return sha256_json(self.to_json())


@dataclass(frozen=True)
class Recipe(_Common):
    """An identity whose model part is a stat fingerprint of the source files, not their digest.

    Its key can be computed with a few ``stat`` calls; the store keeps a recipe -> entry key
    record, so a process with a known recipe maps the entry without hashing or loading the model.
    """

    source_fingerprint: str = field(default="", kw_only=True)

    def __post_init__(self) -> None:
        self._check()
        if not is_key(self.source_fingerprint):
            raise InvalidIdentityError("source_fingerprint must be 64 lowercase hex digits")

    def to_json(self) -> dict[str, Any]:
        return self._body({"fingerprint": self.source_fingerprint, "revision": self.revision})

    @property
    def key(self) -> str:
        return sha256_json({"recipe": self.to_json()})

    def identity(self, model_digest: str) -> EntryIdentity:
        """The entry identity this recipe resolves to once the sources' digest is known."""
        fields = {name: getattr(self, name) for name in _Common.__dataclass_fields__}
        return EntryIdentity(**fields, model_digest=model_digest)


def recipe_for(
    *,
    source_fingerprint: str,
    dtype: str,
    loader: str,
    loader_version: str,
    revision: str | None = None,
    loader_inputs: Mapping[str, str] | None = None,
    components: Sequence[str] = ("transformer",),
    placement: Placement | None = None,
) -> Recipe:
    """Build a recipe, keeping only the weight-relevant part of ``placement``."""
    p = placement or Placement()
    return Recipe(
        revision=revision, dtype=dtype, loader=loader, loader_version=loader_version,
        loader_inputs=tuple(sorted((str(k), str(v)) for k, v in (loader_inputs or {}).items())),
        components=tuple(components), tp_size=p.tp_size, tp_rank=p.tp_rank,
        sp_impl=p.sp_impl if p.sp_size > 1 else None, sp_size=p.sp_size,
        source_fingerprint=source_fingerprint,
    )


def _relative(paths: Sequence[Path], base: Path) -> list[tuple[str, Path]]:
    """(name relative to ``base``, path) of each source file, sorted by name.

    Names are lexical, not resolved: in a hub-cache snapshot every file is a symlink to a blob
    outside the model directory, and its name is still ``transformer/<file>``. Reading follows
    the links.
    """
    root = Path(os.path.abspath(base))
    out = []
    for p in paths:
        # A relative path is relative to the working directory, as ``base`` is: the loader
        # lists ``<model_dir>/transformer/...``, so joining it to ``base`` again would name
        # ``./m/./m/transformer/...`` for ``--model ./m``.
        full = Path(os.path.abspath(p))
        try:
            rel = full.relative_to(root).as_posix()
        except ValueError as e:
            raise InvalidIdentityError(f"model source file {p} is not inside {base}") from e
        out.append((rel, full))
    return sorted(out)


def source_fingerprint(paths: Sequence[Path], base: Path) -> str:
    """A cheap stand-in for the sources' digest: relative names, sizes, inodes, mtimes.

    Not the directory's absolute path: an engine pod sees the model at its mount path, the
    node daemon at the node path, and both must find the same recipe. Device and inode (of a
    symlink's target) still tell two copies apart; any rewrite of a file changes its mtime or
    inode, so a stale fingerprint misses the recipe record and falls back to hashing: it never
    maps a different model's entry.
    """
    files = []
    for rel, full in _relative(paths, base):
        try:
            st = os.stat(full)
        except OSError as e:
            raise InvalidIdentityError(f"cannot stat model source file {full}: {e}") from e
        files.append({"path": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                      "ino": st.st_ino, "dev": st.st_dev})
    return sha256_json({"files": files})


def source_digest(paths: Sequence[Path], base: Path, *, threads: int | None = None) -> str:
    """The model identity: SHA-256 over the sorted relative names, sizes and piece digests."""
    rel = _relative(paths, base)
    sizes = {}
    for name, full in rel:
        try:
            sizes[name] = os.stat(full).st_size
        except OSError as e:
            raise InvalidIdentityError(f"cannot read model source file {full}: {e}") from e
    pieces = hash_spans([Span(full, 0, sizes[name], name) for name, full in rel],
                        piece_bytes=PIECE_BYTES, threads=threads)
    files = []
    for name, full in rel:
        got = pieces[name]
        if isinstance(got, OSError):
            raise InvalidIdentityError(f"cannot read model source file {full}: {got}") from got
        digest = hashlib.sha256(b"".join(got)).hexdigest()
        files.append({"path": name, "size": sizes[name], "pieces_sha256": digest})
    return sha256_json({"piece_bytes": PIECE_BYTES, "files": files})


def identity_for(
    *,
    model_digest: str,
    dtype: str,
    loader: str,
    loader_version: str,
    revision: str | None = None,
    loader_inputs: Mapping[str, str] | None = None,
    components: Sequence[str] = ("transformer",),
    placement: Placement | None = None,
) -> EntryIdentity:
    """The entry identity of a process at ``placement`` (DP and SP rank are dropped)."""
    recipe = recipe_for(source_fingerprint="0" * 64, dtype=dtype, loader=loader,
                        loader_version=loader_version, revision=revision,
                        loader_inputs=loader_inputs, components=components, placement=placement)
    return recipe.identity(model_digest)
