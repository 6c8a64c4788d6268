"""Slot codecs: how a run of stored bytes, once on the device, becomes the bf16 values a
block computes with (the offload's decode stream runs them, ``offload.movement.decode``).

A codec binds a (staged bytes, target view) pair once, when a block's loads are prepared:
``bind`` checks the pair (raising ``FormatError``) and returns the decode to run per load (on
CUDA: queued on the current stream, no allocation of its own beyond the dequantizer's
temporaries, no host sync). Two codecs:

- ``PackedCodec``: a lossless packed bf16 run (``--dlo-compress lossless``) decoded by the
  Triton kernel (``packed_decode``) - the target is the slot's bf16 region;
- ``GGUFCodec``: a block's GGUF linears (``--dlo-dequant slot``): each layer's stored blocks
  dequantized with the same torch function ``GGUFBlockLinear`` uses, cast to the compute
  dtype and written into the layer's place in the target, so the layer then runs a plain
  linear over bits identical to what it would have dequantized itself.

Leaf module: imports no offload code and no loader (the GGUF dequantizer comes with the
layer's ``GGUFQuant``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ditserve.engine.errors import FormatError
from ditserve.engine.formats.gguf_linear import GGUFQuant
from ditserve.engine.formats.packed_decode import check_target, decode_checked
from ditserve.engine.formats.packed_layout import PackedBf16, PackedLayout

Decode = Callable[[], object]


class SlotCodec(Protocol):
    """Decodes staged device bytes into a target view (see the module docstring)."""

    @property
    def name(self) -> str: ...

    def bind(self, staged: torch.Tensor, out: torch.Tensor) -> Decode:
        """Check that ``out`` can receive what ``staged`` decodes to (``FormatError`` if not);
        the returned call writes the decoded values of ``staged`` into ``out``."""
        ...


@dataclass(frozen=True)
class PackedCodec:
    """A packed bf16 run of ``layout`` (the lossless path: the same check once, the same
    ``decode_checked`` per load as before codecs)."""

    layout: PackedLayout
    name: str = "packed-bf16"

    def bind(self, staged: torch.Tensor, out: torch.Tensor) -> Decode:
        packed = PackedBf16(self.layout, staged)
        check_target(packed, out)
        return functools.partial(decode_checked, packed, out)


@dataclass(frozen=True)
class GGUFRun:
    """One GGUF linear's weight: ``nbytes`` stored bytes at ``byte_offset`` of the staged
    region, decoded to a (rows, cols) weight at element ``out_offset`` of the target."""

    byte_offset: int
    nbytes: int
    quant: GGUFQuant
    rows: int
    cols: int
    out_offset: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class GGUFCodec:
    """A block's GGUF linears, dequantized into ``dtype`` (the layers' compute dtype)."""

    runs: tuple[GGUFRun, ...]
    dtype: torch.dtype
    name: str = "gguf"

    @property
    def numel(self) -> int:
        """Target elements the runs reach (their aligned extent)."""
        return max((r.out_offset + r.numel for r in self.runs), default=0)

    def bind(self, staged: torch.Tensor, out: torch.Tensor) -> Decode:
        self.check(staged, out)
        return functools.partial(self.decode, staged, out)

    def check(self, staged: torch.Tensor, out: torch.Tensor) -> None:
        """Raise ``FormatError`` unless ``out`` can receive the runs' weights."""
        if out.dtype != self.dtype or not out.is_contiguous() or out.dim() != 1:
            raise FormatError(f"GGUF slot decode writes a flat contiguous {self.dtype} tensor, "
                              f"got {out.dtype} of shape {tuple(out.shape)}")
        if out.numel() < self.numel:
            raise FormatError(f"the target holds {out.numel()} values; the block's GGUF "
                              f"layers decode to {self.numel}")
        end = max((r.byte_offset + r.nbytes for r in self.runs), default=0)
        if staged.dtype != torch.uint8 or staged.numel() < end:
            raise FormatError(f"the staged region holds {staged.numel()} {staged.dtype} "
                              f"elements; the block's GGUF bytes reach byte {end}")
        if staged.device != out.device:
            raise FormatError(f"staged bytes are on {staged.device} but the target is on "
                              f"{out.device}")

    def decode(self, staged: torch.Tensor, out: torch.Tensor) -> None:
        """Dequantize every run of ``staged`` into its place in ``out``."""
        for run in self.runs:
            q = run.quant
            blocks = staged[run.byte_offset : run.byte_offset + run.nbytes].view(-1, q.type_size)
            # GGUFBlockLinear.forward's own steps: dequantize, reshape, cast to compute dtype.
            weight = q.dequantize(blocks, q.block_size, q.type_size).reshape(run.rows, run.cols)
            out[run.out_offset : run.out_offset + run.numel].view(run.rows, run.cols).copy_(
                weight.to(self.dtype))
