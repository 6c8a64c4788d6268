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
  linear over bits identical to what it would have dequantized itself (Q8_0 and Q4_K on
  CUDA: the fused kernel of ``gguf_fused`` writing straight into the target, as the layer
  would).

diffusers' dequantizers of most types (Q4_K among them where it is not fused; not Q8_0) build
small constant tensors from Python lists on the blocks' device at every call
(``torch.tensor([0, 4], device=...)``): a copy from pageable memory, which synchronizes the
host with the current stream. On the decode stream that stream waits for the next block's
copy, so the host would stall in the prefetch (before the running block's compute is queued)
and the copy, decode and compute would serialize. ``DeviceConstants`` serves those calls from
a cache instead (the same values, made once per device), so a GGUF decode queues without a
host sync and its bits do not change.

Leaf module: imports no offload code and no loader (the GGUF dequantizer comes with the
layer's ``GGUFQuant``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from ditserve.engine.errors import FormatError
from ditserve.engine.formats.gguf_fused import dequantize_into, fused_type
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


# Types whose diffusers dequantizer makes no constant tensor (no need for the cache).
NO_CONSTANTS = frozenset({"Q8_0", "BF16", "F16", "F32"})
_CONSTANTS: dict[tuple[str, str, str], torch.Tensor] = {}


class DeviceConstants(TorchFunctionMode):
    """Inside: ``torch.tensor(values, dtype=..., device=...)`` of a list returns one cached
    tensor per (values, dtype, device) - read-only use only, as diffusers' dequantizers make
    (shift amounts, lookup tables). Every other call runs as is."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if (func is torch.tensor and len(args) == 1 and isinstance(args[0], list | tuple)
                and set(kwargs) <= {"dtype", "device"}):
            key = (repr(args[0]), str(kwargs.get("dtype")), str(kwargs.get("device")))
            cached = _CONSTANTS.get(key)
            if cached is None:
                cached = _CONSTANTS[key] = func(*args, **kwargs)
            return cached
        return func(*args, **kwargs)


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
        """Dequantize every run of ``staged`` into its place in ``out`` (on CUDA with the
        dequantizers' constants cached: no host sync)."""
        if self._needs_constants(staged):
            with DeviceConstants():
                self._decode(staged, out)
        else:
            self._decode(staged, out)

    def _needs_constants(self, staged: torch.Tensor) -> bool:
        """Whether a run on ``staged``'s device calls a diffusers dequantizer that makes
        constant tensors (the fused kernels make none)."""
        return staged.device.type != "cpu" and any(
            r.quant.name not in NO_CONSTANTS and not fused_type(r.quant.name, staged, self.dtype)
            for r in self.runs)

    def _decode(self, staged: torch.Tensor, out: torch.Tensor) -> None:
        for run in self.runs:
            q = run.quant
            blocks = staged[run.byte_offset : run.byte_offset + run.nbytes].view(-1, q.type_size)
            target = out[run.out_offset : run.out_offset + run.numel]
            if fused_type(q.name, blocks, self.dtype):  # no temporaries, no extra copy
                dequantize_into(q.name, blocks, target)
                continue
            # GGUFBlockLinear.forward's own steps: dequantize, reshape, cast to compute dtype.
            weight = q.dequantize(blocks, q.block_size, q.type_size).reshape(run.rows, run.cols)
            target.view(run.rows, run.cols).copy_(weight.to(self.dtype))
