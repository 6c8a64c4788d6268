"""AdapterCatalog: the adapters a replica serves, by name - what clients can ask for.

Owned by the ``DiffusionEngine`` (one per replica, whatever its ranks); read by the HTTP
layer (``/v1/models``, the request fields ``model`` and ``loras``, the load and unload
routes). It turns a client's selection into ``LoraRef``s - the file, the load generation and
the rank - that travel with the request to whichever runner serves it; the runners make
adapters resident from those refs (``bank``), so no adapter state crosses processes.

An adapter is "in use" from its request's admission until the request ends; unloading one
in use is refused. Thread-safe (HTTP handlers and the engine's loop threads). Pure: the
file check is a function the engine passes in (``inspect``: path -> rank, raising
``AdapterError``).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ditserve.engine.config.adapters import AdapterConfig, check_name
from ditserve.engine.errors import (
    AdapterConflictError,
    AdapterError,
    AdapterNotFoundError,
    ConfigError,
)
from ditserve.engine.request import LoraRef


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    path: str
    rank: int
    version: int


class AdapterCatalog:
    """Served adapters by name (see module docstring)."""

    def __init__(self, config: AdapterConfig, *, inspect: Callable[[str], int]) -> None:
        """Registers ``config.lora_modules`` (checked with ``inspect``), generations 0..n-1
        as ``config.startup_refs`` numbers them."""
        self._inspect = inspect
        self._lock = threading.Lock()
        self._entries: dict[str, CatalogEntry] = {}
        self._in_use: Counter[str] = Counter()
        self._next_version = 0
        self.fused: str | None = None
        for name, path in config.lora_modules.items():
            self._add(name, path)
        if config.fuse:
            self.fused = next(iter(config.lora_modules))

    def _add(self, name: str, path: str) -> CatalogEntry:
        rank = self._inspect(path)
        entry = CatalogEntry(name=name, path=path, rank=rank, version=self._next_version)
        self._next_version += 1
        self._entries[name] = entry
        return entry

    def entries(self) -> list[CatalogEntry]:
        with self._lock:
            return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._entries

    def in_use(self, name: str) -> int:
        with self._lock:
            return self._in_use[name]

    # -- selection ------------------------------------------------------------------------
    def resolve(self, selection: Sequence[tuple[str, float]]) -> tuple[LoraRef, ...]:
        """(name, scale) pairs as LoraRefs; an unknown name raises AdapterNotFoundError.
        Under ``fuse`` the fused adapter is already in the weights: naming it adds nothing,
        naming another is refused."""
        out = []
        with self._lock:
            for name, scale in selection:
                entry = self._entries.get(name)
                if entry is None:
                    known = ", ".join(sorted(self._entries)) or "none"
                    raise AdapterNotFoundError(f"adapter {name!r} is not loaded (loaded: "
                                               f"{known}; see GET /v1/models)")
                if self.fused is not None:
                    if name != self.fused or scale != 1.0:
                        raise AdapterError(f"this replica serves adapter {self.fused!r} fused "
                                           "into its weights at scale 1 (--lora-fuse); it "
                                           "cannot apply others or change the scale")
                    continue
                out.append(LoraRef(name=name, path=entry.path, scale=float(scale),
                                   rank=entry.rank, version=entry.version))
        return tuple(out)

    def hold(self, refs: Iterable[LoraRef]) -> None:
        with self._lock:
            for ref in refs:
                self._in_use[ref.name] += 1

    def hold_until_done(self, refs: Sequence[LoraRef], future: Any) -> None:
        """``hold`` until ``future`` (a request's) is done, however it ends."""
        if refs:
            self.hold(refs)
            future.add_done_callback(lambda _: self.release(refs))

    def release(self, refs: Iterable[LoraRef]) -> None:
        with self._lock:
            for ref in refs:
                self._in_use[ref.name] -= 1
                if self._in_use[ref.name] <= 0:
                    del self._in_use[ref.name]

    # -- load / unload ----------------------------------------------------------------------
    def load(self, name: str, path: str) -> CatalogEntry:
        """Register a new adapter (the file is checked first). A name already loaded is
        refused: unload it first."""
        try:
            check_name(name)
        except ConfigError as e:
            raise AdapterError(str(e)) from e
        if self.fused is not None:
            raise AdapterError("this replica serves one adapter fused into its weights "
                               "(--lora-fuse); it loads no others")
        with self._lock:
            if name in self._entries:
                raise AdapterConflictError(f"adapter {name!r} is already loaded; unload it "
                                           "first")
        rank = self._inspect(path)  # outside the lock: reading a file takes a while
        with self._lock:
            if name in self._entries:
                raise AdapterConflictError(f"adapter {name!r} is already loaded; unload it "
                                           "first")
            entry = CatalogEntry(name=name, path=path, rank=rank, version=self._next_version)
            self._next_version += 1
            self._entries[name] = entry
            return entry

    def unload(self, name: str) -> CatalogEntry:
        """Forget an adapter; refused while a request uses it. Runners drop its weights as
        their LRU evicts them (a later load of the name is a new generation)."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
            if self.fused == name:
                raise AdapterError(f"adapter {name!r} is fused into the weights (--lora-fuse)")
            if self._in_use[name] > 0:
                raise AdapterConflictError(f"adapter {name!r} is in use by "
                                           f"{self._in_use[name]} running or queued "
                                           "request(s); retry when they finish")
            del self._entries[name]
            return entry
