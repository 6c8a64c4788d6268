"""StepCacheBlocks: the step cache inside a step's forwards, and the blocks a step needs.

Installed once by the model runner on every block of the DiT's block lists (the lists offload
streams); it wraps each block's ``forward`` beneath ``Module.__call__``, so offload's and the
shape groups' hooks still run around every block call. A DiT's first listed block is its
*head*, its last the *tail*. Per step (``step()``) and per shape-group forward (``forward()``):

- at the head, each request of the forward decides from its own ``RequestCache``: ``every``
  and ``teacache`` before the head runs (teacache reads the head's modulated input or timestep
  projection), ``first-block`` after it (the head's own change). Rows that reuse under
  ``every``/``teacache`` skip the head too;
- the blocks after the head run only the rows that compute: the streams are narrowed to those
  rows once at the head (``index_select``), the per-row inputs (timestep embedding, text mask)
  at each block (and LoRA's row segments with them); a block no row computes is not called
  at all, and offload is told (``needs``) not to copy it;
- at the tail the full rows come back: computed rows as computed (each request stores its new
  residual, tail output minus the hidden states where its cached range starts), reusing rows
  as that start plus their cached residual. When every row computes, nothing is narrowed or
  copied and the block outputs are the plain forward's, bit for bit.

The reuse of a text stream (Flux, Qwen-Image) after the tail is not meaningful; those
families drop it after their last block. Deciding needs the head's change on the host, one
sync per forward for ``first-block`` and ``teacache`` (``every`` needs none).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ditserve.engine.adapters import rows as adapter_rows
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step_cache import decide
from ditserve.engine.step_cache.rows import Member, arg, members, narrow, row_index

log = logging.getLogger(__name__)

# What each family's blocks return, in order (inputs of the same names carry them in).
# A block returning one tensor where its family lists two (FLUX.2's single-stream blocks)
# returns the joint [text, image] sequence: its image tokens are the trailing ones.
BLOCK_OUTPUTS = {"flux": ("encoder_hidden_states", "hidden_states"),
                 "flux2": ("encoder_hidden_states", "hidden_states"),
                 "qwen-image": ("encoder_hidden_states", "hidden_states"),
                 "wan": ("hidden_states",),
                 # Z-Image's main layers: one stream of image and caption tokens, named x.
                 "z-image": ("x",)}
HIDDEN = "hidden_states"


@dataclass(frozen=True)
class _Role:
    dit: str  # the DiT the block belongs to (an expert's name, or "" for a lone DiT)
    index: int
    count: int
    params: tuple[str, ...]  # the block forward's parameter names, in order


@dataclass
class StepRun:
    """One step's totals: whether a DiT's later blocks are needed, and what was skipped
    (block computations: one request through one block)."""

    body_needed: dict[str, bool] = field(default_factory=dict)
    plain: bool = False  # a forward of the step runs without the cache: it needs every block
    skipped_blocks: int = 0
    block_runs: int = 0


@dataclass
class _Pass:
    """One DiT forward of one lane, head to tail."""

    members: list[Member]
    rows: int
    compute: torch.Tensor | None  # row indices that compute the body; None: all rows
    computing: int
    start: torch.Tensor  # (rows, ...) hidden states where each row's cached range starts
    head_out: dict[str, torch.Tensor]
    slices: list[slice]  # the computing rows, in order (LoRA's row segments follow them)


@dataclass
class _Lane:
    states: list[DenoiseState]
    row_slices: list[slice]
    passes: dict[str, _Pass] = field(default_factory=dict)


_LANE: contextvars.ContextVar[_Lane | None] = contextvars.ContextVar("step_cache_lane",
                                                                     default=None)


class StepCacheBlocks:
    """The wrapped blocks of one DiT (or expert stack); see the module docstring."""

    def __init__(self, model: nn.Module, block_lists: Sequence[str], family: str) -> None:
        self.outputs = BLOCK_OUTPUTS.get(family, (HIDDEN,))
        # The stream whose residual is cached: the image tokens (or the one joint stream).
        self.hidden = HIDDEN if HIDDEN in self.outputs else self.outputs[-1]
        self._roles: dict[int, _Role] = {}
        self._restore: list[tuple[nn.Module, Any]] = []
        self._run: StepRun | None = None
        by_dit: dict[str, list[nn.Module]] = {}
        for name in block_lists:
            listed = model.get_submodule(name)
            assert isinstance(listed, nn.ModuleList), f"{name} is not a block list"
            by_dit.setdefault(name.rpartition(".")[0], []).extend(listed)
        for dit, blocks in by_dit.items():
            for index, block in enumerate(blocks):
                params = tuple(inspect.signature(type(block).forward).parameters)[1:]
                self._roles[id(block)] = _Role(dit, index, len(blocks), params)
                self._restore.append((block, block.__dict__.get("forward")))
                block.forward = self._wrap(block, block.forward)  # type: ignore[method-assign]

    def close(self) -> None:
        for block, forward in self._restore:
            if forward is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = forward  # type: ignore[method-assign]
        self._restore.clear()

    @contextlib.contextmanager
    def step(self) -> Iterator[StepRun]:
        """One engine step: its forwards' decisions and counts land in the StepRun."""
        self._run = run = StepRun()
        try:
            yield run
        finally:
            self._run = None

    @contextlib.contextmanager
    def forward(self, states: Sequence[DenoiseState], row_slices: Sequence[slice]) -> Iterator[None]:
        """Around one shape group's forward: ``states`` and their rows in the batch. A forward
        of requests without a cache runs the plain blocks."""
        lane = None
        if any(s.step_cache is not None for s in states):
            lane = _Lane(list(states), list(row_slices))
        elif self._run is not None:
            self._run.plain = True
        token = _LANE.set(lane)
        try:
            yield
        finally:
            _LANE.reset(token)

    def needs(self, block: nn.Module) -> bool:
        """Whether a row of the running step computes ``block`` (offload copies only those).
        Heads always load: every policy's decision starts there."""
        role, run = self._roles.get(id(block)), self._run
        if role is None or run is None or run.plain or role.index == 0:
            return True
        return run.body_needed.get(role.dit, True)

    # -- the wrapped forward -------------------------------------------------------------------
    def _wrap(self, block: nn.Module, inner: Callable[..., Any]) -> Callable[..., Any]:
        role = self._roles[id(block)]

        def forward(*args: Any, **kwargs: Any) -> Any:
            lane = _LANE.get()
            if lane is None or role.count < 2:
                return inner(*args, **kwargs)
            if role.index == 0:
                return self._head(lane, role, block, inner, args, kwargs)
            p = lane.passes.get(role.dit)
            if p is None:  # the head ran without the cache (rows did not match)
                return inner(*args, **kwargs)
            if p.computing == p.rows:
                out = inner(*args, **kwargs)
            elif p.computing == 0:
                out = self._identity(role, args, kwargs)
            else:
                assert p.compute is not None
                n_args, n_kwargs = narrow(args, kwargs, p.rows, p.compute)
                with adapter_rows.narrowed(p.slices):  # the LoRA rows computing here
                    out = inner(*n_args, **n_kwargs)
            if role.index == role.count - 1:
                lane.passes.pop(role.dit)
                out = self._tail(role, p, out)
            return out

        forward.__wrapped__ = inner  # type: ignore[attr-defined]  # what it wraps (compiled or not)
        return forward

    def _streams(self, out: Any) -> dict[str, torch.Tensor]:
        values = out if isinstance(out, tuple) else (out,)
        names = self.outputs if len(values) == len(self.outputs) else (self.hidden,)
        return dict(zip(names, values, strict=True))

    def _pack(self, streams: dict[str, torch.Tensor]) -> Any:
        values = tuple(streams[name] for name in self.outputs if name in streams)
        return values if len(values) > 1 else values[0]

    def _identity(self, role: _Role, args: tuple, kwargs: dict) -> Any:
        # A stream the block takes as None (a joint-sequence block's text) is not returned.
        given = {name: arg(role.params, args, kwargs, name) for name in self.outputs}
        return self._pack({name: value for name, value in given.items() if value is not None})

    def _head(self, lane: _Lane, role: _Role, block: nn.Module, inner: Callable[..., Any],
              args: tuple, kwargs: dict) -> Any:
        hidden = arg(role.params, args, kwargs, self.hidden)
        rows = int(hidden.shape[0])
        found = members(lane.states, lane.row_slices, rows)
        if found is None:
            log.warning("step cache: a forward of %d rows matches no request layout; it runs "
                        "without the cache", rows)
            if self._run is not None:
                self._run.body_needed[role.dit] = True  # sticky: the step needs every block
            return inner(*args, **kwargs)
        decide.before_head(role.dit, found,
                           lambda kind: _indicator(kind, role, block, args, kwargs))
        head_rows = [m for m in found if not m.skips_head]
        if len(head_rows) == len(found):
            out = inner(*args, **kwargs)
        elif not head_rows:
            out = self._identity(role, args, kwargs)
        else:
            index = row_index(head_rows, hidden.device)
            n_args, n_kwargs = narrow(args, kwargs, rows, index)
            with adapter_rows.narrowed([m.rows for m in head_rows]):
                part = self._streams(inner(*n_args, **n_kwargs))
            full = {name: arg(role.params, args, kwargs, name).clone() for name in self.outputs}
            for name, tensor in full.items():
                tensor.index_copy_(0, index, part[name])
            out = self._pack(full)
        streams = self._streams(out)
        decide.after_head(role.dit, found, hidden, streams[self.hidden])
        return self._begin_pass(lane, role, found, rows, hidden, streams)

    def _begin_pass(self, lane: _Lane, role: _Role, found: list[Member], rows: int,
                    hidden_in: torch.Tensor, streams: dict[str, torch.Tensor]) -> Any:
        hidden_out = streams[self.hidden]
        computing = [m for m in found if not m.reuse]
        # Where each row's cached range starts: after the head for first-block rows (the
        # head ran), before it for every/teacache (their residual covers the head too).
        late = [m for m in found if m.cache is not None and m.cache.policy != "first-block"]
        if not late:
            start = hidden_out
        elif len(late) == len(found):
            start = hidden_in
        else:
            start = hidden_out.clone()
            for m in late:
                start[m.rows] = hidden_in[m.rows]
        self._count(role, found, computing)
        n = sum(m.rows.stop - m.rows.start for m in computing)
        compute = None if n == rows else row_index(computing, hidden_out.device)
        lane.passes[role.dit] = _Pass(found, rows, compute, n, start, streams,
                                      [m.rows for m in computing])
        if compute is None:
            return self._pack(streams)
        return self._pack({k: v.index_select(0, compute) for k, v in streams.items()})

    def _count(self, role: _Role, found: list[Member], computing: list[Member]) -> None:
        run = self._run
        for m in found:
            skipped = (role.count - 1 + int(m.skips_head)) if m.reuse else 0
            if m.cache is not None:
                m.cache.skipped_blocks += skipped
                m.cache.block_runs += role.count
            if run is not None:
                run.skipped_blocks += skipped
                run.block_runs += role.count
        if run is not None:
            run.body_needed[role.dit] = run.body_needed.get(role.dit, False) or bool(computing)

    def _tail(self, role: _Role, p: _Pass, out: Any) -> Any:
        streams = self._streams(out)
        start = p.start
        joint = streams[self.hidden].shape[1] != start.shape[1]  # [text, image] out, image in
        if joint:  # the reused rows' text tokens are the head's (the DiT drops them)
            start = torch.cat([p.head_out[name] for name in self.outputs if name != self.hidden]
                              + [start], dim=1)
        if p.compute is not None:  # some rows reused: rebuild the full rows
            full = {}
            for name, part in streams.items():
                full[name] = (start if name == self.hidden else p.head_out[name]).clone()
                if p.computing:
                    full[name].index_copy_(0, p.compute, part)
            streams = full
        hidden = streams[self.hidden]
        if joint:  # the residual is the image tokens'
            hidden = hidden[:, hidden.shape[1] - p.start.shape[1]:]
        for m in p.members:
            if m.cache is None:
                continue
            if m.reuse:
                residual = m.cache.residual[role.dit]
                # A joint stream padded to its batch's longest row (Z-Image's image and
                # caption tokens) may be longer or shorter than when the residual was stored;
                # a row's own tokens lie within both, the rest is padding nobody reads.
                common = min(residual.shape[1], hidden.shape[1]) if hidden.dim() > 1 else None
                if common is None or common == hidden.shape[1] == residual.shape[1]:
                    hidden[m.rows] += residual
                else:
                    hidden[m.rows, :common] += residual[:, :common]
            else:
                m.cache.residual[role.dit] = hidden[m.rows] - p.start[m.rows]
        return self._pack(streams) if p.compute is not None else out


def _indicator(kind: str, role: _Role, block: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    """TeaCache's watched input for every row of the forward: the head's modulated input
    (``norm1``: Flux's AdaLayerNormZero, block 0's own weights) or its timestep input."""
    temb = arg(role.params, args, kwargs, "temb")
    if kind == "norm1":
        norm: Any = block.norm1  # Flux: AdaLayerNormZero -> (normed, gates...)
        return norm(arg(role.params, args, kwargs, HIDDEN), emb=temb)[0]
    return temb
