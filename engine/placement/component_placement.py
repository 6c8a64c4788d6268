"""Where a pipeline's components live: text encoders parked in host memory, and their bytes.

``ParkedModules`` keeps modules' weights in host memory (page-locked on CUDA, so an upload
is a queued DMA, not a host sync) and places them on the device only for one pass
(``on_device()``). Weights never change, so going back costs nothing: the parameters point
at their host copies again and the device copies are freed (the caching allocator reuses
them only after the queued encoder kernels that read them, same stream). The math runs on
the same device with the same bytes as resident encoders, so outputs are identical.

Built by ``engine.placement.whole_pipeline`` when ``--offload dlo`` governs the encoders.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext

import torch

log = logging.getLogger(__name__)


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (shared tensors once)."""
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


def _pinned(host: torch.Tensor, pin: bool) -> torch.Tensor:
    if not pin:
        return host
    try:
        return host.pin_memory()
    except RuntimeError as e:  # e.g. a locked-memory limit: pageable still works, slower
        log.warning("cannot pin a parked weight (%s); it stays pageable", e)
        return host


class ParkedModules:
    """Modules whose weights live in host memory and visit ``device`` for one pass each."""

    def __init__(self, modules: Mapping[str, torch.nn.Module], *, device: torch.device) -> None:
        self.device = device
        self.names = tuple(modules)
        self.bytes = {name: module_bytes(m) for name, m in modules.items()}
        pin = device.type == "cuda"
        self.pinned = pin
        # (tensor whose .data moves, its host copy); parameters and buffers alike.
        self._weights: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._visits = 0  # on_device depth
        seen: set[int] = set()
        with torch.inference_mode(False), torch.no_grad():
            for module in modules.values():
                module.to("cpu")
                for tensor in (*module.parameters(), *module.buffers()):
                    if id(tensor) in seen:
                        continue
                    seen.add(id(tensor))
                    tensor.data = _pinned(tensor.data, pin)
                    self._weights.append((tensor, tensor.data))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the device copies made at build are gone

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @contextmanager
    def on_device(self) -> Iterator[None]:
        """The modules' weights on the device for the body, back in host memory after.
        Reentrant: a nested visit (a cache miss inside a step's placement) moves nothing."""
        self._visits += 1
        try:
            with self._placed() if self._visits == 1 else nullcontext():
                yield
        finally:
            self._visits -= 1

    @contextmanager
    def _placed(self) -> Iterator[None]:
        same = self.device.type == "cpu"
        # Outside inference mode: these tensors are the modules' own, not inference tensors.
        with torch.inference_mode(False), torch.no_grad():
            if not same:
                for tensor, host in self._weights:
                    tensor.data = host.to(self.device, non_blocking=self.pinned)
        try:
            yield
        finally:
            with torch.inference_mode(False), torch.no_grad():
                for tensor, host in self._weights:
                    tensor.data = host

    def where(self) -> str:
        return "host (pinned)" if self.pinned else "host"
