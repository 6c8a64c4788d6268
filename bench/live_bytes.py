"""Counting the bytes of live tensors op by op: a device's activation peak without the device.

Shared by the memory programs (``cosmos3_layer_memory.py``, ``flux_phase_memory.py``) and the
tests that hold the planner's activation estimates against a real forward. Run a module's
forward on the ``meta`` device (full-size shapes, no weights, no compute: seconds on a laptop)
or on the CPU under ``LiveBytes``: every op's new outputs add their storage's bytes while they
are alive (a ``weakref.finalize`` takes them back), and the largest sum is the peak.

What it sees is what the model's code allocates, as CUDA would. Two differences, both small:
``scaled_dot_product_attention`` reaches the mode as one op, so an attention counts as its
output only - flash attention's footprint on the GPU (its working set is a few MiB; the CPU's
math path would hold the S x S scores, which CUDA never does); and the caching allocator's
rounding, the cuBLAS workspaces and fragmentation are not counted (on an H100 a Flux step
under DLO measured 1.16-1.24x this count: docs/benchmarks.md, "Issue 45 item 12").
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensors ops have created and that are still alive, and their peak.

    ``where``: a label of what is running (``track_modules`` sets it to the innermost module);
    ``peak_op``: the op, and where it ran, at which the peak was reached."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.peak_op = ""
        self.where = "forward"

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # A view op's output shares its input's bytes; in-place and out= ops return a tensor
        # they were given: nothing new. (Below autograd, ``Tensor._is_view`` is not set.)
        given = {id(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        fresh = not func.is_view
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if fresh and isinstance(t, torch.Tensor) and id(t) not in given:
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                weakref.finalize(t, self._release, nbytes)
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, f"{func} in {self.where}"
        return out


def track_modules(model: torch.nn.Module, counted: LiveBytes, root: str = "forward") -> None:
    """Name the innermost running submodule of ``model`` in ``counted.where``."""
    for name, module in model.named_modules():
        def enter(_m: torch.nn.Module, _a: Any, name: str = name) -> None:
            counted.where = name or root

        module.register_forward_pre_hook(enter)


def peak_bytes(fn: Any, *args: Any, **kwargs: Any) -> tuple[int, str]:
    """(peak live bytes, the op at the peak) of ``fn(*args, **kwargs)`` in inference mode,
    above what was alive before it (its inputs are not counted; its output is)."""
    counted = LiveBytes()
    with torch.inference_mode(), counted:
        out = fn(*args, **kwargs)
    del out
    return counted.peak, counted.peak_op
