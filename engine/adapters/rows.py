"""Which rows of the running forward carry which adapters: a context variable.

The model runner's ``GroupForwards`` sets it around each shape group's ``denoise_step``
(``applying``), from the batch's requests and their row slices; the adapter hooks
(``linear``) read it in every adapted linear layer. A context variable, not an attribute:
multi-shape steps run each group's forward in its own greenlet, interleaved at block
boundaries, and each greenlet has its own context. A pipeline that runs a forward over a
subset of the batch's rows (Wan 2.2's experts) narrows it (``narrowed``).

Pure: no torch.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ditserve.engine.request import SamplingParams

AdapterKey = tuple[str, int]  # LoraRef.key: (name, load generation)


@dataclass(frozen=True)
class RowSegment:
    """Rows [start, stop) of the forward apply ``adapters``: (key, scale) pairs."""

    start: int
    stop: int
    adapters: tuple[tuple[AdapterKey, float], ...]


@dataclass(frozen=True)
class RowAdapters:
    """The adapters of a forward over ``rows`` rows; rows in no segment have none."""

    rows: int
    segments: tuple[RowSegment, ...]

    def narrowed(self, slices: Sequence[slice]) -> RowAdapters:
        """The same adapters for a forward over the rows of ``slices``, concatenated."""
        segments, start = [], 0
        for sl in slices:
            for seg in self.segments:
                lo, hi = max(seg.start, sl.start), min(seg.stop, sl.stop)
                if lo < hi:
                    segments.append(RowSegment(start + lo - sl.start, start + hi - sl.start,
                                               seg.adapters))
            start += sl.stop - sl.start
        return RowAdapters(start, tuple(segments))


_CURRENT: contextvars.ContextVar[RowAdapters | None] = contextvars.ContextVar(
    "ditserve_row_adapters", default=None)


def current() -> RowAdapters | None:
    return _CURRENT.get()


def of_requests(params: Sequence[SamplingParams], row_slices: Sequence[slice],
                rows: int) -> RowAdapters | None:
    """The adapters of a batch (None when no request has one)."""
    segments = tuple(
        RowSegment(sl.start, sl.stop, tuple((ref.key, float(ref.scale)) for ref in p.loras))
        for p, sl in zip(params, row_slices, strict=True) if p.loras)
    return RowAdapters(rows, segments) if segments else None


@contextlib.contextmanager
def applying(adapters: RowAdapters | None) -> Iterator[None]:
    token = _CURRENT.set(adapters)
    try:
        yield
    finally:
        _CURRENT.reset(token)


@contextlib.contextmanager
def narrowed(slices: Sequence[slice]) -> Iterator[None]:
    """Inside: the current adapters of the rows of ``slices`` only (see module docstring)."""
    adapters = _CURRENT.get()
    with applying(None if adapters is None else adapters.narrowed(slices)):
        yield
