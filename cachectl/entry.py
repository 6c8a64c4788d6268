"""A joined cache entry: its manifest, its reader lease and read-only mmap'd tensors.

Returned by ``CacheStore.join`` / ``ensure`` / ``publish`` after validation. While an Entry
is open its shared lease keeps GC away; ``close`` (or leaving the ``with``) drops it. Tensors
come from ``safetensors`` with ``framework="pt"``, which maps the files and shares their pages
through the page cache with every other process mapping the same entry (no dtype casts here:
a cast would copy). torch is imported only when tensors are asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditserve.cachectl.locks import HeldLock
from ditserve.cachectl.manifest import Manifest


@dataclass(frozen=True)
class TensorLocation:
    """Where a tensor's bytes lie: for callers that map the file themselves (host registration)."""

    file: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


class Entry:
    """An open, validated entry. ``validated_by`` is "hash" or "stamp" (see docs/cachectl.md)."""

    def __init__(self, path: Path, manifest: Manifest, lease: HeldLock, *,
                 validated_by: str, built: bool = False, via_recipe: bool = False) -> None:
        self.path = path
        self.manifest = manifest
        self._lease: HeldLock | None = lease
        self.validated_by = validated_by
        self.built = built
        self.via_recipe = via_recipe
        self._handles: list[Any] = []

    @property
    def key(self) -> str:
        return self.manifest.key

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes

    @property
    def closed(self) -> bool:
        return self._lease is None

    def files(self) -> list[Path]:
        return [self.path / f.name for f in self.manifest.files]

    def tensor_locations(self) -> dict[str, TensorLocation]:
        return {t.name: TensorLocation(self.path / t.file, t.offset, t.nbytes, t.dtype, t.shape)
                for t in self.manifest.tensors}

    def tensors(self, names: Iterable[str] | None = None) -> dict[str, Any]:
        """The entry's tensors as torch tensors backed by the shared file mapping."""
        from safetensors import safe_open

        self._require_open()
        wanted = set(names) if names is not None else None
        by_file: dict[str, list[str]] = {}
        for t in self.manifest.tensors:
            if wanted is None or t.name in wanted:
                by_file.setdefault(t.file, []).append(t.name)
        out: dict[str, Any] = {}
        for file, tensor_names in by_file.items():
            handle = safe_open(str(self.path / file), framework="pt")
            self._handles.append(handle)  # keep the mapping alive as long as the entry
            for name in tensor_names:
                out[name] = handle.get_tensor(name)
        if wanted is not None and wanted - out.keys():
            missing = ", ".join(sorted(wanted - out.keys()))
            raise KeyError(f"entry {self.key} has no tensor(s) {missing}")
        return out

    def _require_open(self) -> None:
        if self._lease is None:
            raise RuntimeError(f"entry {self.key} is closed; join it again")

    def close(self) -> None:
        """Drop the lease. Tensors already handed out stay valid (the mapping outlives the fd)."""
        self._handles.clear()
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def __enter__(self) -> Entry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Entry({self.key[:12]}, {self.total_bytes} bytes, {self.path})"
