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
from ditserve.cachectl.st_format import ITEMSIZE

_ITEMSIZE = ITEMSIZE


class _DtypeTable(dict):  # type: ignore[type-arg]
    """safetensors dtype name -> torch dtype, built on first use (keeps torch out of imports)."""

    def __missing__(self, name: str) -> Any:
        import torch

        table = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
                 "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
                 "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64,
                 "F8_E5M2": torch.float8_e5m2, "F8_E4M3": torch.float8_e4m3fn}
        self.update(table)
        return table[name]


_TORCH_DTYPES = _DtypeTable()


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
        # After a recipe miss: whether recipe -> key was recorded (not on a read-only mount).
        self.recipe_recorded: bool | None = None
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

    def readonly_tensors(self, names: Iterable[str] | None = None) -> dict[str, Any]:
        """Tensors over a PROT_READ shared mapping of the shards: a write faults instead of
        copying the page. For host registration (``cudaHostRegisterReadOnly``) and for callers
        that must prove they never modify the weights. ``tensors()`` gives private
        copy-on-write mappings instead (what safetensors does), equally shared until written.
        """
        import mmap
        import warnings

        import torch

        self._require_open()
        wanted = set(names) if names is not None else None
        maps: dict[str, mmap.mmap] = {}
        out: dict[str, Any] = {}
        for t in self.manifest.tensors:
            if wanted is not None and t.name not in wanted:
                continue
            if t.file not in maps:
                with open(self.path / t.file, "rb") as f:
                    maps[t.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            dtype = _TORCH_DTYPES[t.dtype]
            count = t.nbytes // _ITEMSIZE[t.dtype]
            with warnings.catch_warnings():
                # torch warns that the buffer is not writable: that is the point here.
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(maps[t.file], dtype=dtype, count=count, offset=t.offset) \
                    if count else torch.empty(0, dtype=dtype)
            out[t.name] = flat.view(t.shape)
        if wanted is not None and wanted - out.keys():
            raise KeyError(f"entry {self.key} has no tensor(s) {', '.join(sorted(wanted - out.keys()))}")
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
