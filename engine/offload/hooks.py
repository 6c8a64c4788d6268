"""Hooks: stream blocks through a ring of device slots (two by default) around each forward.

Per streamed block, in call order (circular, so the last blocks prefetch the first ones and
the next step starts warm):

- pre-forward of block k: make sure k is in a slot (normally prefetched; a miss loads it
  now), have the compute stream wait for its bytes, repoint k's parameters/buffers into
  the slot (zero-copy views prepared at enable time; the Parameter objects stay the same),
  then start loading blocks k+1 .. k+slots-1 that are not in a slot yet, each into the slot
  of a block that already ran. Two slots overlap one copy with one block's compute; more
  let the copies run further ahead, which pays when some blocks compute for longer than they
  take to copy and others the other way round (a step is then bounded by the sum of copies,
  not by the slower of the two per block);
- post-forward of block k: mark the slot free on the compute stream, and turn k's tensors
  into placeholders (zero-stride views of one scalar: right shape and dtype, no storage).

A slot's bytes stay valid until overwritten, so a block already in a slot is never loaded
again (with no more streamed blocks than slots nothing moves after the first step). Weights are read-only:
this is an inference path.

Passes (AllGather mode, ``strict=True``): every load is then a collective, so every rank must
issue the same loads in the same order. Loads depend only on the streamer's state, so ranks
stay matched as long as each runs whole *passes* (blocks 0..n-1, once each, in order):
``idle_pass`` runs a pass's hook steps without running the blocks (a rank with no batch), a
forward that raises mid-way is completed by ``finish_pass`` (a root forward hook that runs
even on exceptions), and a block called out of order is refused before it loads anything.

Repeats (multi-shape steps, ``engine.block_major``): a step may run a block once per shape
group before the next block. A repeat finds the block still in its slot and its window already
loaded, so it loads nothing and moves nothing; the slot is reused only once the block has left
the window, i.e. after every group ran it (the driver starts no group on block k+1 before all
ran block k). Strict mode accepts a repeat of the block it ran last. A step's forwards form ONE
pass: inside ``one_pass()`` the end of each forward does not end the pass, leaving the scope
does. ``passes`` counts passes in both modes (a forward of the model outside a scope is one).

Skips (step cache, ``engine.step_cache``): ``demand`` - set through the handle's
``skip_unneeded`` - says per block module whether any row of the running step computes it. A
block no row needs is neither loaded nor pointed (its forward, which the step cache short-cuts,
reads no weight), and nothing is prefetched for it: the next block that is needed finds the
ring as the last needed block left it, so when a whole step reuses its cached residuals, its
blocks cost no bytes and the ring stays warm for the next step. ``skipped_bytes`` counts the
bytes of skipped blocks that were not in a slot already. Strict mode never skips: its loads
are collectives the other ranks join.

Released slots (``movement.slot_release``, ``enable_offload(release_slots=True)``: streamed
text encoders, which run once per request): the end of a pass gives the slots' storages back
and the first block of the next pass grows them again, so no prefetch crosses the pass's end
(the window does not wrap: its bytes would be freed unread) and every pass starts cold, one
miss each. A pass then also ends with the innermost module holding every block list (the
``scope``, ``builders.pass_scope``: a pipeline may call ``encoder.model``, not the encoder).

Called by the backend's builders (build, attach) and ``handle`` (detach, idle passes); the
copy sources come from a ``host`` backing, the bytes move through a ``movement`` transfer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ditserve.engine.errors import OffloadError
from ditserve.engine.offload.movement.slot_release import SlotRelease
from ditserve.engine.offload.movement.transfer import Transfer
from ditserve.engine.offload.plan import BlockLayout


@dataclass
class StreamedBlock:
    """One streamed block and everything its hooks need, prepared once."""

    name: str
    module: nn.Module
    tensors: list[torch.Tensor]  # the block's Parameter/buffer objects, in layout order
    views: list[list[torch.Tensor]]  # per slot: a view per tensor
    copies: list[Any]  # per slot: the transfer's prepared load of (slot region, host source)
    placeholders: list[torch.Tensor]
    nbytes: int
    # Derived tensors (``slot_dequant``: GGUF weights decoded into a slot region): pointed like
    # the block's own tensors, but no stored tensor stands behind them (disable gives nothing
    # back to them; their owner's ``restore`` unsets them).
    derived: list[torch.Tensor] = field(default_factory=list)
    derived_views: list[list[torch.Tensor]] = field(default_factory=list)  # per slot
    derived_placeholders: list[torch.Tensor] = field(default_factory=list)


def placeholder(base: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A zero-stride view of the 0-d ``base``: keeps shape/dtype/device, holds no storage."""
    return base.expand(tuple(shape))


def make_streamed_block(
    layout: BlockLayout,
    module: nn.Module,
    tensors: list[torch.Tensor],
    *,
    slots: Sequence[Mapping[Hashable, torch.Tensor]],
    host_regions: Mapping[Hashable, Any],
    placeholder_bases: Mapping[Hashable, torch.Tensor],
    prepare: Callable[[Sequence[tuple[torch.Tensor, Any]], int], Any],
) -> StreamedBlock:
    """Precompute a block's views into every slot, its prepared loads (``prepare``: the
    transfer's, given (slot region, host source) pairs and the slot's index) and its
    placeholders.

    Done once at enable time, outside any inference-mode context, so the hooks only swap
    ``.data`` pointers and never create tensors.
    """
    views = [
        [slot[p.dtype][p.offset : p.offset + p.numel].view(p.shape) for p in layout.tensors]
        for slot in slots
    ]
    copies = [
        prepare([(slot[r.dtype][: r.numel], host_regions[r.dtype]) for r in layout.regions], s)
        for s, slot in enumerate(slots)
    ]
    return StreamedBlock(
        name=layout.name,
        module=module,
        tensors=tensors,
        views=views,
        copies=copies,
        placeholders=[placeholder(placeholder_bases[p.dtype], p.shape) for p in layout.tensors],
        nbytes=layout.nbytes,
    )


class BlockStreamer:
    """The per-block hook state machine over a ring of slots."""

    def __init__(
        self, blocks: Sequence[StreamedBlock], transfer: Transfer, *, strict: bool = False,
        slot_release: SlotRelease | None = None,
    ) -> None:
        self.blocks = list(blocks)
        self.transfer = transfer
        self.strict = strict  # whole passes only (AllGather: loads are collectives)
        self.slot_release = slot_release  # slots given back between passes (module docstring)
        self.position = 0  # strict: the block the current pass runs next
        self.passes = 0  # completed passes (forwards, one_pass scopes, idle passes)
        self._started = False  # a block ran in the current pass
        self._held = False  # inside one_pass(): forwards' ends do not end the pass
        self._ended_in_scope = False  # a forward ended (or raised) inside one_pass()
        self.slots = len(self.blocks[0].views) if self.blocks else 2
        self.loaded: list[int | None] = [None] * self.slots  # block position held by each slot
        self.pointed: dict[int, int] = {}  # block position -> slot its tensors point into
        self.bytes_transferred = 0
        self.skipped_bytes = 0  # blocks no row needed, not loaded (step cache)
        self.demand: Callable[[nn.Module], bool] | None = None
        self.loads = 0
        self.misses = 0
        self._handles: list[RemovableHandle] = []

    def attach(self, root: nn.Module | None = None, scope: nn.Module | None = None) -> None:
        for k, block in enumerate(self.blocks):
            self._handles.append(block.module.register_forward_pre_hook(self._pre_hook(k)))
            # always_call: a block that raises still releases its slot (the free event is
            # recorded behind whatever it queued) before another group runs it.
            self._handles.append(block.module.register_forward_hook(self._post_hook(k),
                                                                    always_call=True))
        if root is not None:
            # always_call: a forward that raises still completes its pass, so this rank's
            # collectives stay matched with the other ranks'.
            self._handles.append(root.register_forward_hook(
                lambda module, args, output: self._forward_ended(), always_call=True))
        if scope is not None and scope is not root:
            # Released slots: a forward of the scope alone ends a pass too. Inside the root's
            # forward, the root's end then finds the pass finished and does nothing.
            self._handles.append(scope.register_forward_hook(
                lambda module, args, output: self._forward_ended(), always_call=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre_hook(self, k: int):
        def hook(module: nn.Module, args: tuple) -> None:
            self.before_block(k)

        return hook

    def _post_hook(self, k: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            self.after_block(k)

        return hook

    def _load(self, k: int, slot: int) -> None:
        block = self.blocks[k]
        self.transfer.load(block.copies[slot], slot)
        self.loaded[slot] = k
        self.loads += 1
        self.bytes_transferred += block.nbytes

    def _point(self, k: int, slot: int | None) -> None:
        block = self.blocks[k]
        targets = block.placeholders if slot is None else block.views[slot]
        for tensor, target in zip(block.tensors, targets, strict=True):
            tensor.data = target
        if block.derived:  # only blocks with GGUF layers under --dlo-dequant slot
            targets = block.derived_placeholders if slot is None else block.derived_views[slot]
            for tensor, target in zip(block.derived, targets, strict=True):
                tensor.data = target
        if slot is None:
            self.pointed.pop(k, None)
        else:
            self.pointed[k] = slot

    def before_block(self, k: int) -> None:
        self._started = True
        if not self.strict and self.demand is not None and not self.demand(self.blocks[k].module):
            # No row of this step computes block k: leave the ring as it is (no load, no
            # prefetch); its tensors stay placeholders, which its skipped forward never reads.
            if k not in self.loaded:
                self.skipped_bytes += self.blocks[k].nbytes
            return
        if self.slot_release is not None and not self.slot_release.allocated:
            self.slot_release.restore()  # the pass's first block: the slots come back, empty
        if self.strict:
            if k == self.position - 1:
                pass  # a repeat (another shape group): k and its window sit in slots
            elif k != self.position:
                raise OffloadError(
                    f"block {self.blocks[k].name} ran out of order (expected "
                    f"{self.blocks[self.position % len(self.blocks)].name}); AllGather mode needs "
                    "every forward to run each streamed block once, in order"
                )
            else:
                self.position += 1
        window = self._window(k)  # k and the blocks to prefetch after it
        slot = self.loaded.index(k) if k in self.loaded else None
        if slot is None:
            # Miss: the first forward, or blocks ran out of the expected order (or a forward
            # was aborted mid-way). Fence all compute queued so far before reusing a slot,
            # and drop any stale pointers into slots.
            self.misses += 1
            slot = self._victim(window)
            for other in list(self.pointed):
                self._point(other, None)
            self.transfer.release(slot)
            self._load(k, slot)
        self.transfer.wait_ready(slot)
        self._point(k, slot)
        for nxt in window[1:]:
            if nxt not in self.loaded:
                # The victim slot held a block that already ran; its release (recorded after
                # that block's forward) orders this copy behind the block's last read.
                self._load(nxt, self._victim(window))

    def _window(self, k: int) -> list[int]:
        """Block k and the blocks after it (circularly) that should sit in slots now."""
        n = len(self.blocks)
        if self.slot_release is not None:  # the slots go back at the pass's end: no wrap
            return list(range(k, min(k + self.slots, n)))
        return [(k + j) % n for j in range(min(self.slots, n))]

    def _victim(self, window: list[int]) -> int:
        """A slot to load into: an empty one, else the one whose block is needed again last.

        Blocks run in a loop, so outside the window the block needed last is the one that
        ran most recently (furthest ahead, circularly, of the window's start); its compute
        was queued before block k's, so a copy into its slot waits no longer than k's start.
        Deterministic: AllGather ranks must pick the same slot.
        """
        if None in self.loaded:
            return self.loaded.index(None)
        n, start = len(self.blocks), window[0]
        candidates = [s for s, b in enumerate(self.loaded) if b not in window]
        return max(candidates, key=lambda s: (int(self.loaded[s]) - start) % n)  # type: ignore[arg-type]

    def after_block(self, k: int) -> None:
        slot = self.pointed.get(k)
        if slot is None:  # not ours to release (hooks re-entered); nothing points into a slot
            return
        self.transfer.release(slot)
        self._point(k, None)

    def idle_pass(self) -> None:
        """A pass's hook steps without running any block: the same loads as a forward."""
        if self.position:
            self.finish_pass()
        for k in range(len(self.blocks)):
            self.before_block(k)
            self.after_block(k)
        self.finish_pass()

    def finish_pass(self) -> None:
        """Complete the current pass: release a block left pointed (its forward raised), then
        (strict) take the hook steps of every block it did not reach."""
        for k in list(self.pointed):
            self.after_block(k)
        if self.strict:
            while self.position < len(self.blocks):
                k = self.position
                self.before_block(k)
                self.after_block(k)
            self.position = 0
        if self.slot_release is not None:
            self.slot_release.release()
            self.loaded = [None] * self.slots  # their bytes are gone with the storage
        self.passes += 1
        self._started = False

    def _forward_ended(self) -> None:
        """The model's forward returned or raised: the end of a pass, unless a step's
        forwards share one (``one_pass``)."""
        if self._held:
            self._ended_in_scope = True
        elif self.strict or self._started:
            self.finish_pass()

    @contextlib.contextmanager
    def one_pass(self) -> Iterator[None]:
        """Everything run inside is one pass: a step's forwards, one per shape group, however
        many run each block. Strict mode completes the pass on leaving (also after an error),
        if any forward started; a scope in which nothing ran is no pass (an AllGather rank
        then joins the others with ``idle_pass``). Nested scopes are the outer one."""
        if self._held:
            yield
            return
        self._held, self._ended_in_scope = True, False
        try:
            yield
        finally:
            self._held = False
            if self._started or (self.strict and self._ended_in_scope):
                self.finish_pass()
