"""The adapter hook of one DiT linear layer: base output for every row, then each adapter's
low-rank delta added to its own rows.

``AdaptedLinear`` sits on an ``nn.Linear`` (or an ``FP8Linear``: the delta is computed in the
activations' dtype, bf16, while the base matmul stays FP8) as a forward hook, so layerwise
offload - which repoints the layer's weights into device slots - and the weight formats do not
change: the base matmul runs as before, once for all rows of the step; the hook reads which
rows carry which adapters (``rows.current()``) and, per row segment and adapter,

    out[rows] += (scale * scaling) * (x[rows] @ down.T) @ up.T

(two matmuls over that segment's rows only - or, for S adjacent equal segments of one
adapter each, two batched matmuls for all of them: a rank-r adapter on a d x d layer costs 2r/d of
the base work for its rows, 4% for rank 64 on Flux's 3072). A segment's rows are contiguous
in every activation of the DiT, so ``x[rows]`` and ``out[rows]`` are views, and the second
matmul accumulates into the output in place (``addmm_``). Layers whose input flattens rows
with tokens (Wan 2.2 TI2V's per-token timestep embedding) have k inputs per row, row-major;
the segments scale by k.

Factors live on the device in the compute dtype, resident beside the offload slots; the
bank (``bank``) adds and removes them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ditserve.engine.adapters.files import LoraFactors
from ditserve.engine.adapters.rows import AdapterKey, RowSegment, current
from ditserve.engine.errors import AdapterError


class AdaptedLinear:
    """The adapters of one linear layer and its forward hook (see module docstring)."""

    def __init__(self, name: str, module: nn.Module, *, grouped: bool = True) -> None:
        """grouped: use the batched path when a step's segments allow it (see ``_grouped``)."""
        self.name = name
        self.module = module
        layer: Any = module  # nn.Linear or FP8Linear: both carry their feature counts
        self.in_features = int(layer.in_features)
        self.out_features = int(layer.out_features)
        self.factors: dict[AdapterKey, LoraFactors] = {}
        self._handle: RemovableHandle | None = None
        self.grouped = grouped
        # The stacked factors of the last grouped combination (steady state: reused each
        # step): (segments' (key, scale) pairs) -> (down (S, r, in), scaled up (S, out, r)).
        self._stack: tuple[tuple[Any, ...], torch.Tensor, torch.Tensor] | None = None

    def check(self, factors: LoraFactors) -> None:
        """Refuse factors of another shape than this layer's."""
        if factors.down.shape[1] != self.in_features or factors.up.shape[0] != self.out_features:
            raise AdapterError(
                f"the adapter's factors for {self.name} are {tuple(factors.up.shape)} x "
                f"{tuple(factors.down.shape)}, but the layer is {self.in_features} -> "
                f"{self.out_features}: the adapter was trained for another model")

    def add(self, key: AdapterKey, factors: LoraFactors) -> None:
        self.check(factors)
        self.factors[key] = factors
        self._stack = None
        if self._handle is None:
            # First among the layer's hooks: the delta is part of the layer's output, which
            # later hooks see whole (SP's gather on the DiT's final proj_out was attached
            # at start; running before it, the delta joins each rank's own tokens).
            self._handle = self.module.register_forward_hook(self._hook, prepend=True)

    def remove(self, key: AdapterKey) -> None:
        self.factors.pop(key, None)
        self._stack = None
        if not self.factors and self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor
              ) -> torch.Tensor | None:
        adapters = current()
        if adapters is None:
            return None
        x = args[0]
        lead = int(x.shape[0])
        if lead % adapters.rows:
            raise AdapterError(f"{self.name}: an input of {lead} leading rows does not split "
                               f"into the forward's {adapters.rows} rows")
        per_row = lead // adapters.rows
        flat_out = output.view(-1, self.out_features) if output.is_contiguous() else None
        if flat_out is not None and self.grouped and self._grouped(adapters.segments, x,
                                                                   flat_out, per_row):
            return output
        for seg in adapters.segments:
            active = [(self.factors[key], scale) for key, scale in seg.adapters
                      if key in self.factors]
            if not active:
                continue
            lo, hi = seg.start * per_row, seg.stop * per_row
            rows_x = x[lo:hi].reshape(-1, self.in_features)
            target = (flat_out[lo * _tokens(x):hi * _tokens(x)] if flat_out is not None
                      else None)
            for factors, scale in active:
                down = factors.down if factors.down.dtype == rows_x.dtype else \
                    factors.down.to(rows_x.dtype)
                up = factors.up if factors.up.dtype == rows_x.dtype else factors.up.to(rows_x.dtype)
                shrunk = rows_x @ down.t()  # (tokens, rank)
                alpha = float(scale) * factors.scaling
                if target is not None:
                    target.addmm_(shrunk, up.t(), alpha=alpha)
                else:
                    delta = (shrunk @ up.t()) * alpha
                    output[lo:hi] += delta.view_as(output[lo:hi])
        return output


    def _grouped(self, segments: tuple[RowSegment, ...], x: torch.Tensor,
                 flat_out: torch.Tensor, per_row: int) -> bool:
        """The deltas of S adjacent, equally long segments of one adapter each, all of one
        rank, as two batched matmuls (``bmm`` + ``baddbmm_``) instead of 2S: the common case
        of a step of single-adapter requests of one shape. False (nothing done) otherwise."""
        if len(segments) < 2 or any(len(s.adapters) != 1 for s in segments):
            return False
        size = segments[0].stop - segments[0].start
        if any(s.stop - s.start != size for s in segments) or any(
                b.start != a.stop for a, b in zip(segments, segments[1:], strict=False)):
            return False
        pairs = tuple(s.adapters[0] for s in segments)
        if any(key not in self.factors for key, _ in pairs) or len(
                {self.factors[key].rank for key, _ in pairs}) != 1:
            return False
        if self._stack is None or self._stack[0] != pairs or self._stack[1].dtype != x.dtype:
            down = torch.stack([self.factors[key].down for key, _ in pairs]).to(x.dtype)
            up = torch.stack([self.factors[key].up * (float(scale) * self.factors[key].scaling)
                              for key, scale in pairs]).to(x.dtype)
            self._stack = (pairs, down, up)
        _, down, up = self._stack
        lo, hi = segments[0].start * per_row, segments[-1].stop * per_row
        count = len(segments)
        rows_x = x[lo:hi].reshape(count, -1, self.in_features)  # (S, tokens, in)
        shrunk = torch.bmm(rows_x, down.transpose(1, 2))  # (S, tokens, rank)
        tokens = _tokens(x)
        target = flat_out[lo * tokens:hi * tokens].view(count, -1, self.out_features)
        target.baddbmm_(shrunk, up.transpose(1, 2))
        return True


def _tokens(x: torch.Tensor) -> int:
    """Inputs per leading index (tokens of a (rows, tokens, features) activation)."""
    count = 1
    for size in x.shape[1:-1]:
        count *= int(size)
    return count
