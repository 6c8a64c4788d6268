"""VAE decode of a step's finished requests: batched by shape, tiled by the budget.

Called by ``engine.placement.whole_pipeline`` for the requests the ModelRunner decodes in one
step. Requests whose latents have the same shape (same size, frames and rows) are decoded in
one VAE call, as many as fit the decode's room; a call that fails is retried one request at a
time, so only the culprit fails. Each request's decode is whole or tiled by a rule that looks
at that request alone - never at how many share its call - so a request's pixels do not
depend on its neighbours (the VAE's convolutions and group norms work per row):

- with an HBM budget (``BudgetPlan``), tiled when one whole decode of the request would not
  fit the plan's decode room (``--vae-tiling on``/``off`` force it);
- without one, ``vae_decode.tiling_wanted``'s pixel rule, and calls may batch up to the
  step's own activation estimate, so batching never raises the peak above a denoise step.

The decode is queued on the compute stream like today: it still overlaps the next step's
host work, and the pixels' copy to pinned host memory is queued too.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ditserve.engine.pipelines.capabilities import decodes_in_batches
from ditserve.engine.pipelines.vae_decode import VaeTiling, tiling_wanted
from ditserve.engine.placement.memory_estimates import decode_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeRule:
    """How a request's decode is done, from the budget (``room``) or the pixel rule."""

    mode: str  # --vae-tiling: auto, on, off
    offload: bool
    video: bool
    room: int | None  # activation bytes a decode call may use; None: no budget
    batch_room: int  # what a batched call may use when there is no budget

    def tiled(self, vae: Any, state: Any, *, can_tile: bool) -> bool:
        if not can_tile or self.mode == "off":
            return False
        if self.mode == "on":
            return True
        p = state.params
        if self.room is None:
            return tiling_wanted("auto", offload=self.offload, height=int(p.height),
                                 width=int(p.width), video=self.video)
        return decode_bytes(vae, tiled=False, **_shape(state)) > self.room

    def batch(self, vae: Any, state: Any, *, tiled: bool, most: int) -> int:
        """How many requests shaped like ``state`` one call decodes (at least one)."""
        room = self.room if self.room is not None else self.batch_room
        shape = _shape(state)
        rows = shape.pop("rows")
        k = most
        while k > 1 and decode_bytes(vae, tiled=tiled, rows=k * rows, **shape) > room:
            k -= 1
        return k


def _shape(state: Any) -> dict[str, int]:
    p = state.params
    assert state.latents is not None
    return {"rows": int(state.latents.shape[0]), "frames": int(getattr(p, "num_frames", 1) or 1),
            "height": int(p.height), "width": int(p.width)}


def _group_key(state: Any) -> tuple[Any, ...]:
    p = state.params
    return (tuple(state.latents.shape), int(p.height), int(p.width),
            int(getattr(p, "num_frames", 1) or 1))


class DecodeBatches:
    """Decodes a step's finished requests (module docstring)."""

    def __init__(self, pipeline: Any, tiling: VaeTiling | None, rule: DecodeRule,
                 post_decode: Callable[[Any], None]) -> None:
        self.pipeline = pipeline
        self.tiling = tiling
        self.rule = rule
        self._post_decode = post_decode  # the pipeline's own, untouched by tiling
        # A pipeline whose decode reads more of a request than its latents and size (Wan
        # I2V mixes each request's first-frame latents in) decodes one request per call.
        self.batchable = decodes_in_batches(pipeline)
        self.calls = 0  # VAE calls of finished requests (previews not counted)
        self.decoded = 0  # finished requests they decoded

    def one(self, state: Any) -> None:
        """Decode one request (and previews): the rule's tiling for it, alone."""
        self._call([state], self._tiled(state))

    def _tiled(self, state: Any) -> bool:
        return self.rule.tiled(self.pipeline.vae, state, can_tile=self.tiling is not None)

    def run(self, states: Sequence[Any]) -> dict[str, str]:
        """Decode ``states`` (each gets ``pixels``); the failed ones' request ids, and why."""
        failed: dict[str, str] = {}
        groups: dict[tuple[Any, ...], list[Any]] = {}
        for state in states:
            groups.setdefault(_group_key(state), []).append(state)
        for group in groups.values():
            tiled = self._tiled(group[0])
            most = len(group) if self.batchable else 1
            size = self.rule.batch(self.pipeline.vae, group[0], tiled=tiled, most=most)
            for start in range(0, len(group), size):
                failed.update(self._chunk(group[start:start + size], tiled))
        return failed

    def _chunk(self, chunk: list[Any], tiled: bool) -> dict[str, str]:
        try:
            self._call(chunk, tiled)
            self.calls += 1
            self.decoded += len(chunk)
            return {}
        except Exception as e:
            if len(chunk) == 1:
                log.exception("request %s failed in decode", chunk[0].request_id)
                return {chunk[0].request_id: f"decode failed: {type(e).__name__}: {e}"}
        log.warning("a batched decode of %d requests failed; decoding them one by one",
                    len(chunk), exc_info=True)
        failed: dict[str, str] = {}
        for state in chunk:
            failed.update(self._chunk([state], tiled))
        return failed

    def _call(self, chunk: list[Any], tiled: bool) -> None:
        if self.tiling is not None:
            self.tiling.set(tiled)
        try:
            if len(chunk) == 1:
                self._post_decode(chunk[0])
            else:
                self._batched(chunk)
        finally:
            if self.tiling is not None:
                self.tiling.set(False)

    def _batched(self, chunk: list[Any]) -> None:
        # One state carrying every request's latents: same size and frames, so the
        # pipeline's decode reads the same params; (k*n, ...) rows, split back after.
        combined = copy.copy(chunk[0])
        combined.latents = torch.cat([s.latents for s in chunk])
        self._post_decode(combined)
        start = 0
        for state in chunk:
            rows = int(state.latents.shape[0])
            state.pixels = combined.pixels[start:start + rows]
            start += rows
