"""Host registration of mapped weight files: plan the ranges, register all or none.

With a positive ``--dlo-pin-limit-gib``, the streamed tensors' file ranges are page-locked
in place so block loads DMA straight from the shared mapping (no host copy, full PCIe
speed). Planning is pure: group the source ranges by file, widen each to page boundaries,
coalesce overlapping or adjacent ones, and check the total against the budget - before
anything is registered. Registration is all or nothing: any refused range (or a source
tensor that does not report pinned afterwards) unregisters every range registered so far,
newest first, and the caller keeps the staging path; if that rollback itself fails the
process state is unknown and startup aborts (``OffloadError``).

CUDA refuses ``cudaHostRegister`` on a writable file mapping; the mappings come from
``weights.checkpoint_mmap`` (``PROT_READ``) and are registered with ``cudaHostRegisterReadOnly``.
The ``Registrar`` interface lets CPU tests run the whole sequence against a fake.

Called by ``mapped.MappedBacking.register``; torn down by ``MappedBacking.close`` (after a
synchronize, before the mappings close).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ditserve.engine.errors import OffloadError

log = logging.getLogger(__name__)
PAGE = 4096
CUDA_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the device only reads


@dataclass(frozen=True)
class SourceRange:
    """Bytes ``[start, start + nbytes)`` of mapping ``file`` that a block load reads."""

    file: str
    start: int
    nbytes: int


@dataclass(frozen=True)
class HostRange:
    """A page-aligned range to register: ``start`` bytes into mapping ``file``."""

    file: str
    start: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes


def plan_ranges(sources: Iterable[SourceRange], *, page: int = PAGE) -> list[HostRange]:
    """Group by file, page-align, coalesce overlapping/adjacent ranges; sorted by file, start."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for s in sources:
        if s.nbytes <= 0:
            continue
        start = s.start // page * page
        end = -(-(s.start + s.nbytes) // page) * page
        by_file.setdefault(s.file, []).append((start, end))
    out: list[HostRange] = []
    for file in sorted(by_file):
        spans = sorted(by_file[file])
        cur_start, cur_end = spans[0]
        for start, end in spans[1:]:
            if start <= cur_end:  # overlapping or touching: one registration
                cur_end = max(cur_end, end)
            else:
                out.append(HostRange(file, cur_start, cur_end - cur_start))
                cur_start, cur_end = start, end
        out.append(HostRange(file, cur_start, cur_end - cur_start))
    return out


class Registrar(Protocol):
    """Page-locks host ranges. ``register`` raises ``RegistrationRefused`` on failure."""

    def register(self, address: int, nbytes: int) -> None: ...
    def unregister(self, address: int) -> None: ...


class RegistrationRefused(Exception):
    """A range could not be registered (or verified); the staging path is used instead."""


class CudaRegistrar:
    """``cudaHostRegister(..., cudaHostRegisterReadOnly)`` / ``cudaHostUnregister``."""

    def __init__(self) -> None:
        import torch

        self._cudart = torch.cuda.cudart()

    def register(self, address: int, nbytes: int) -> None:
        err = self._cudart.cudaHostRegister(address, nbytes, CUDA_HOST_REGISTER_READ_ONLY)
        if err != self._cudart.cudaError.success:
            raise RegistrationRefused(
                f"cudaHostRegister({nbytes} bytes, ReadOnly): "
                f"{self._cudart.cudaGetErrorString(err)}"
            )

    def unregister(self, address: int) -> None:
        err = self._cudart.cudaHostUnregister(address)
        if err != self._cudart.cudaError.success:
            raise RegistrationRefused(
                f"cudaHostUnregister: {self._cudart.cudaGetErrorString(err)}"
            )


class Registration:
    """Registered ranges, in registration order; ``unregister_all`` undoes them newest first."""

    def __init__(self, registrar: Registrar) -> None:
        self._registrar = registrar
        self.ranges: list[tuple[int, HostRange]] = []  # (address, range)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for _, r in self.ranges)

    def unregister_all(self) -> None:
        """Unregister newest first. A failure aborts: memory may stay locked (OffloadError)."""
        while self.ranges:
            address, r = self.ranges[-1]
            try:
                self._registrar.unregister(address)
            except RegistrationRefused as e:
                raise OffloadError(
                    f"could not unregister {r.nbytes} bytes of {r.file} ({e}); the host "
                    "registration state is unknown - restart the process (set "
                    "--dlo-pin-limit-gib 0 to stream through staging buffers instead)"
                ) from e
            self.ranges.pop()


def register_ranges(
    ranges: Sequence[HostRange],
    *,
    addresses: Mapping[str, int],
    budget_bytes: int,
    registrar: Registrar,
    verify: Callable[[], str | None] = lambda: None,
) -> Registration:
    """Register every range (all or none). Raises ``RegistrationRefused`` with the reason
    (budget, a refused range, or ``verify``'s complaint) after rolling back; raises
    ``OffloadError`` if the rollback fails.

    addresses: mapping name -> start address; verify: called after the last range, returns
    None when every source reports pinned, else what is wrong.
    """
    total = sum(r.nbytes for r in ranges)
    if total > budget_bytes:  # checked before any mutation
        raise RegistrationRefused(
            f"registering {total} bytes ({len(ranges)} ranges) exceeds the pin limit of "
            f"{budget_bytes} bytes; raise --dlo-pin-limit-gib to at least "
            f"{-(-total * 100 // 2**30) / 100:.2f}"
        )
    registration = Registration(registrar)
    try:
        for r in ranges:
            address = addresses[r.file] + r.start
            registrar.register(address, r.nbytes)
            registration.ranges.append((address, r))
        problem = verify()
        if problem is not None:
            raise RegistrationRefused(problem)
    except RegistrationRefused:
        registration.unregister_all()  # OffloadError if this fails: abort startup
        raise
    return registration
