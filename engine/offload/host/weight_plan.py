"""HostWeightPlan: the one-way contract from the loader to the offload backend.

A plan says where the DiT's host bytes live (its ``kind``: ``ordinary`` private tensors,
``checkpoint_mmap`` views of the checkpoint's safetensors, ``runtime_cache`` views of a node
cache entry), how every runtime tensor is bound to a file range (``bindings``), how much of
the model that covers, and why this backing was chosen (``reason``: the fallback reason when
a backing was refused).

Ownership: the plan owns the read-only mappings and the cache entry lease behind its views;
``close`` drops them (the kernel unmaps a file when its last view is gone). It is handed to
the backend exactly once (``consume``). A plan whose loader skipped ordinary materialization
(the DiT's tensors exist only as views the plan describes) must be consumed before startup
completes: ``require_consumed`` turns a forgotten hand-over into a hard error instead of a
model silently running on whatever the loader left behind.

Built by ``backing_choice`` (called by the model runner); consumed by ``backend.enable_offload``
(a ``mapped.MappedBacking`` takes it; for AllGather shards the backend copies the shards out
of its mapping and closes it).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ditserve.engine.errors import OffloadError

log = logging.getLogger(__name__)


class BackingKind(str, enum.Enum):
    """Where the DiT's host bytes live."""

    ORDINARY = "ordinary"
    CHECKPOINT_MMAP = "checkpoint_mmap"
    RUNTIME_CACHE = "runtime_cache"

    def __str__(self) -> str:
        return self.value


# The bounded set of transforms a binding may ask for between file bytes and runtime tensor.
# Only the identity exists today: anything that would cast or copy (dtype change, transpose,
# fused QKV split) breaks page sharing and is refused by the preflight instead.
TRANSFORMS: tuple[str | None, ...] = (None,)


@dataclass(frozen=True)
class TensorBinding:
    """Runtime tensor ``name`` = bytes ``[offset, offset + nbytes)`` of ``file`` (its ``key``)."""

    name: str
    file: Path
    key: str
    offset: int  # absolute byte offset of the tensor's data in the file
    nbytes: int
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    transform: str | None = None


@dataclass(frozen=True)
class Coverage:
    """How much of the DiT the bindings cover (``bound == expected`` for a mapped backing)."""

    expected: int  # parameters + persistent buffers of the DiT
    bound: int
    bound_bytes: int

    @property
    def complete(self) -> bool:
        return self.bound == self.expected


class HostWeightPlan:
    """Where the DiT's host bytes live; handed to the backend exactly once."""

    def __init__(
        self,
        kind: BackingKind,
        *,
        reason: str,
        bindings: Mapping[str, TensorBinding] | None = None,
        sources: Mapping[str, Any] | None = None,
        mappings: Sequence[Any] = (),
        coverage: Coverage | None = None,
        skipped_materialization: bool = False,
        lease: Any = None,
        auto_pin_limit_bytes: int = 0,
    ) -> None:
        """sources: runtime name -> tensor view over ``mappings`` (read-only file maps);
        lease: the cache entry (closed with the plan); auto_pin_limit_bytes: the registration
        budget the loader chose for this mapping when ``--dlo-pin-limit-gib`` was not set
        (``weights.host_fit``: a checkpoint on tmpfs is registered, not copied; 0: none)."""
        bindings = dict(bindings or {})
        if kind is not BackingKind.ORDINARY:
            if not bindings or sources is None or set(bindings) != set(sources):
                raise OffloadError(f"a {kind} plan needs one source view per binding")
            bad = [b.name for b in bindings.values() if b.transform not in TRANSFORMS]
            if bad:
                raise OffloadError(f"unsupported tensor transform for {bad[0]}")
        self.kind = kind
        self.reason = reason
        self.bindings: dict[str, TensorBinding] = bindings
        self._sources: dict[str, Any] = dict(sources or {})
        self._mappings = list(mappings)
        self.coverage = coverage or Coverage(0, 0, 0)
        self.skipped_materialization = skipped_materialization
        self._lease = lease
        self.auto_pin_limit_bytes = auto_pin_limit_bytes if kind is not BackingKind.ORDINARY \
            else 0
        self._consumed = False
        self._closed = False

    @classmethod
    def ordinary(cls, reason: str) -> HostWeightPlan:
        """Private host tensors (the loader materialized the DiT); ``reason`` says why."""
        return cls(BackingKind.ORDINARY, reason=reason)

    @property
    def mapped(self) -> bool:
        return self.kind is not BackingKind.ORDINARY

    @property
    def consumed(self) -> bool:
        return self._consumed

    @property
    def mappings(self) -> list[Any]:
        return list(self._mappings)

    def consume(self) -> dict[str, Any]:
        """Take the plan (once): returns runtime name -> source view (empty for ordinary)."""
        if self._consumed:
            raise OffloadError(
                "this HostWeightPlan was already handed to an offload backend; a plan is "
                "consumed exactly once - load the model again to enable offload again"
            )
        if self._closed:
            raise OffloadError("this HostWeightPlan is closed; load the model again")
        self._consumed = True
        return dict(self._sources)

    def require_consumed(self) -> None:
        """Raise if the loader skipped ordinary materialization and nobody took the plan."""
        if self.skipped_materialization and not self._consumed:
            self.close()
            raise OffloadError(
                f"the loader bound the DiT to a {self.kind} mapping instead of loading it, but "
                "no offload backend consumed the plan; refusing to start on unbound weights "
                "(enable offload with the plan, or set --dlo-checkpoint-mmap off)"
            )

    def describe(self) -> dict[str, Any]:
        """JSON-able facts for logs and ``/ready``."""
        return {
            "backing_kind": str(self.kind),
            "backing_reason": self.reason,
            "bound_tensors": self.coverage.bound,
            "expected_tensors": self.coverage.expected,
            "mapped_bytes": self.coverage.bound_bytes,
            "mapped_files": len(self._mappings),
            "skipped_materialization": self.skipped_materialization,
            "auto_pin_limit_bytes": self.auto_pin_limit_bytes,
        }

    def close(self) -> None:
        """Drop the mappings and the cache lease (idempotent).

        Tensors still viewing a mapping keep it alive; it is unmapped when the last goes.
        Callers that registered ranges of these mappings unregister them first.
        """
        if self._closed:
            return
        self._closed = True
        self._sources.clear()
        for mapping in self._mappings:
            mapping.close()
        self._mappings.clear()
        if self._lease is not None:
            self._lease.close()
            self._lease = None
