"""Where a replica's start goes: named phases from process start to READY.

Owns ``StartTimeline``: the engine (``loop.engine``) makes one per start and hands it down (``open_executor`` ->
the executor -> ``ModelRunner`` -> ``assemble``); each part wraps its work in
``timeline.phase(name)``. Phases, in the order they run:

    process       interpreter start to the engine's start (torch, the server's imports,
                  arguments); the model's libraries are not imported yet
    cuda_init     creating the CUDA context on this process's device (on its own thread,
                  while ``imports`` and ``read`` run: they overlap, so the phases' sum
                  exceeds their wall time)
    imports       importing the model's diffusers pipeline class: diffusers, transformers,
                  the DiT, VAE and text-encoder classes (``weights.loader``)
    read          reading the weights into host memory (safetensors, mmap, the node cache)
    place         building the pipeline and moving its resident parts to the device
    pin_register  layerwise offload: pinning or registering host memory, slots, hooks
    encoders      the whole-pipeline plan: encoder placement, prompt cache, VAE tiling
    warm_up       the one-step warm-up request on every rank
    compile       --compile: the warm-up steps that compile the DiT blocks
    load          a multi-process replica's ranks loading in their own processes (rank 0
                  sees their load as one phase)

On READY the engine logs one line per phase and the total, and ``report()`` feeds the
server's ``/metrics`` (``ditserve:start_phase_seconds{phase}``,
``ditserve:start_to_ready_seconds``). Standard library only; nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

PHASES = ("process", "cuda_init", "imports", "read", "place", "pin_register", "encoders",
          "warm_up", "compile", "load")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), or None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks after boot) follows the ')' of the command.
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartTimeline:
    """Seconds per start phase, and start to ready; thread-safe (ranks may report)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 process_age: Callable[[], float | None] = process_age_s) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}
        self._started = clock()
        self._before = process_age() or 0.0  # the process's age when the engine started
        self._ready_s: float | None = None
        if self._before:
            self._seconds["process"] = self._before

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``name`` (added up when a phase runs more than once)."""
        if name not in PHASES:
            raise ValueError(f"unknown start phase {name!r}; add it to start_phases.PHASES")
        began = self._clock()
        try:
            yield
        finally:
            took = self._clock() - began
            with self._lock:
                self._seconds[name] = self._seconds.get(name, 0.0) + took
            log.info("start phase %s: %.2fs", name, took)

    def ready(self) -> float:
        """Mark READY; log the phases and the total (process start to ready). Returns it."""
        with self._lock:
            self._ready_s = self._before + (self._clock() - self._started)
            seconds = dict(self._seconds)
        shown = ", ".join(f"{name} {seconds[name]:.2f}s" for name in PHASES if name in seconds)
        other = self._ready_s - sum(seconds.values())
        log.info("ready %.2fs after process start (%s; other %.2fs)", self._ready_s, shown,
                 max(other, 0.0))
        return self._ready_s

    def report(self) -> dict[str, Any]:
        """``{"phases": {name: seconds}, "start_to_ready_s": total or None}``."""
        with self._lock:
            return {"phases": {n: self._seconds[n] for n in PHASES if n in self._seconds},
                    "start_to_ready_s": self._ready_s}


def timed(timeline: StartTimeline | None, name: str) -> contextlib.AbstractContextManager[None]:
    """``timeline.phase(name)``, or nothing without a timeline (a runner built by a test)."""
    return timeline.phase(name) if timeline is not None else contextlib.nullcontext()
