"""The serving process's garbage collector: startup's objects kept out of its scans, and its
pauses timed.

After start a server holds hundreds of thousands of long-lived objects (torch, diffusers,
transformers, the model's modules): 425k with the tiny Flux, where one full collection takes
0.15-0.22 s on a 2-core CI machine, and more on a GPU host whose cores imported the same
libraries 3x slower. CPython's full collections traverse all of them while holding the GIL, so
the step loop cannot queue the next step meanwhile and the GPU idles. Serving allocates few
lasting objects (48 requests of the tiny server ran no full collection), so such a pause is
rare, but it lands on whatever request is running. Freezing the heap once the engine is ready
(``gc.freeze``, as vLLM does after its start) moves startup's objects to a permanent generation
that collections skip; objects made while serving are collected as before. The server thaws it
on stop, so a process that starts engines one after another (the test suite, a notebook) does
not keep the stopped ones' cycles for ever.

``GcPauses`` times every collection (``gc.callbacks``): totals per generation on ``/metrics``
(``ditserve:gc_pause_seconds``, ``ditserve:gc_collections``), and those over 20 ms logged at
DEBUG (``ditserve -v serve``) beside the step log's lines, so a gap between forwards can be
told apart from a collection.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

LOGGED_PAUSE_S = 0.02


def freeze_startup_heap() -> int:
    """Collect once, then freeze what survives; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("froze %d objects of the startup heap out of the garbage collector's scans",
             frozen)
    return frozen


def thaw_heap() -> None:
    """Give the frozen objects back to the collector (the oldest generation)."""
    gc.unfreeze()


class GcPauses:
    """Seconds and counts of the collector's passes per generation, while installed."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter,
                 logged_s: float = LOGGED_PAUSE_S) -> None:
        self._clock = clock
        self._logged_s = logged_s
        self._started = threading.local()  # a collection runs in the thread that set it off
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]

    def totals(self) -> tuple[list[float], list[int]]:
        """Seconds and passes per generation so far (``/metrics``: ``ditserve:gc_*``)."""
        return list(self.seconds), list(self.collections)

    def install(self) -> GcPauses:
        gc.callbacks.append(self._on_collection)
        return self

    def remove(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started.at = self._clock()
            return
        started = getattr(self._started, "at", None)
        if started is None:  # installed during a collection
            return
        self._started.at = None
        elapsed = self._clock() - started
        generation = int(info.get("generation", 2))
        self.seconds[generation] += elapsed
        self.collections[generation] += 1
        if elapsed >= self._logged_s and log.isEnabledFor(logging.DEBUG):
            log.debug("garbage collection of generation %d took %.1f ms (%d collected, "
                      "%d objects frozen out of its scans)", generation, 1e3 * elapsed,
                      int(info.get("collected", 0)), gc.get_freeze_count())
