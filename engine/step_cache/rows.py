"""Rows of a forward and the requests they belong to, for the step cache's block wrappers.

A shape group's forward runs its requests' rows in batch order (``InputBatch.row_slices``);
Wan 2.2 may run a forward per expert over a subset of them (``forward_rows``). ``members``
maps the rows a block sees back to requests; the ``narrow`` helpers cut a block's per-row
inputs down to the rows that compute.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step_cache.policies import RequestCache

_SUBSET: contextvars.ContextVar[tuple[slice, ...] | None] = contextvars.ContextVar(
    "step_cache_subset", default=None)


@dataclass
class Member:
    """One request in one DiT forward: its rows there, its cache, and this step's decision."""

    state: DenoiseState
    rows: slice
    cache: RequestCache | None
    reuse: bool = False
    skips_head: bool = False


@contextlib.contextmanager
def forward_rows(slices: Sequence[slice]) -> Iterator[None]:
    """Inside, the running forward holds only these row slices of its batch, in this order
    (Wan 2.2 runs one forward per expert over its rows when a batch straddles the switch)."""
    token = _SUBSET.set(tuple(slices))
    try:
        yield
    finally:
        _SUBSET.reset(token)


def members(states: Sequence[DenoiseState], row_slices: Sequence[slice],
            rows: int) -> list[Member] | None:
    """The requests of a forward of ``rows`` rows, with their rows in it; None when the rows
    match no layout of the batch (the forward then runs without the cache)."""
    pairs = list(zip(states, row_slices, strict=True))
    subset = _SUBSET.get()
    if subset is not None:
        wanted = {(s.start, s.stop) for s in subset}
        pairs = [(st, sl) for st, sl in pairs if (sl.start, sl.stop) in wanted]
    found, at = [], 0
    for state, sl in pairs:
        size = sl.stop - sl.start
        found.append(Member(state, slice(at, at + size), state.step_cache))
        at += size
    return found if at == rows else None


def row_index(chosen: Sequence[Member], device: torch.device) -> torch.Tensor:
    """The rows of ``chosen`` as an index tensor on ``device`` (a pinned-free small upload)."""
    rows = [r for m in chosen for r in range(m.rows.start, m.rows.stop)]
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def arg(params: Sequence[str], args: tuple, kwargs: dict, name: str) -> Any:
    """A block call's argument ``name`` (keyword, or positional by the forward's signature)."""
    if name in kwargs:
        return kwargs[name]
    index = list(params).index(name)
    return args[index] if index < len(args) else None


def _take(value: Any, rows: int, index: torch.Tensor) -> Any:
    """A per-row tensor of the full forward, narrowed to ``index``; anything else (shared
    tensors such as rotary embeddings, tuples, streams already narrowed) as it is."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
        return value.index_select(0, index)
    return value


def narrow(args: tuple, kwargs: dict, rows: int, index: torch.Tensor) -> tuple[tuple, dict]:
    return (tuple(_take(a, rows, index) for a in args),
            {k: _take(v, rows, index) for k, v in kwargs.items()})
