"""The served model's libraries imported on a thread of their own while the start goes on.

Importing the family's diffusers pipeline class (diffusers, transformers, the DiT, VAE and
text-encoder classes) is the longest part of a start before the weights (issue 50: 5-8 s on
a GPU host). ``ditserve serve`` starts it on a background thread (``import_in_background``)
as soon as it knows the family, and the main thread goes on building the HTTP server, which
listens and starts the engine meanwhile; the engine's start joins it first thing
(``loop.startup.open_executor``: ``join_model_imports``), before anything of it can reach
diffusers - resolving the model builds the embedded tiny one or checks a checkpoint file
against the DiT's class - and ``runner.assembly.read_weights`` makes sure the classes it
needs are imported (``wait_for_model_imports``: in place where nothing was started).

What keeps two threads importing at once safe: Python locks each module while it runs, so a
module imported from both threads runs once and the second one waits - but a thread that
reaches a package's submodule while the other is still running the package's ``__init__``
goes ahead without waiting, and may see it half built. So the background thread imports one
fixed thing, the pipeline class, and before it starts the caller imports on its own thread
what both sides would otherwise import at once (``SHARED_FIRST``: torch, and the HTTP stack
huggingface_hub shares with uvicorn; ``tests/server/test_serve_imports.py`` keeps that list
complete). Nothing else imports diffusers or transformers before the join (the same test).

Errors: whatever the import raises (a missing package, a broken install) is kept and raised
again, the same exception, by the join - the engine's start fails with it as it did when the
imports ran in place. Timing: the thread's own duration is the start phase ``imports``
(recorded at the join, so it overlaps ``process`` and the phases after it), and how long the
join waited is ``imports_wait``: what the overlap did not hide.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ditserve.engine.families import Family
from ditserve.engine.runner.start_phases import StartTimeline, timed
from ditserve.engine.weights.loader import import_pipeline_class

log = logging.getLogger(__name__)

# Imported on the caller's thread before the background thread starts: what the server's
# build and the model's libraries both import (huggingface_hub's httpx and uvicorn share
# anyio, h11 and sniffio; anyio imports its submodules lazily, so the ones both use are named).
SHARED_FIRST = ("torch", "h11", "sniffio", "anyio.to_thread", "anyio._core._tasks",
                "anyio._core._typedattr", "anyio.abc._resources", "anyio.abc._streams",
                "anyio.abc._tasks")


class ModelImports:
    """One background import of ``family``'s pipeline class; ``join`` waits and re-raises."""

    def __init__(self, family: Family, *,
                 importer: Callable[[Family], Any] | None = None) -> None:
        self.family = family
        self._importer = importer
        self._failure: BaseException | None = None
        self.seconds: float | None = None  # the import's own duration, once it ended
        self._thread = threading.Thread(target=self._run, name="model-imports", daemon=True)

    def start(self) -> ModelImports:
        for name in SHARED_FIRST:
            importlib.import_module(name)
        self._thread.start()
        return self

    def _run(self) -> None:
        began = time.monotonic()
        try:
            (self._importer or import_pipeline_class)(self.family)
        except BaseException as e:  # raised again by join, on the thread that needs them
            self._failure = e
        finally:
            self.seconds = time.monotonic() - began

    def join(self, timeline: StartTimeline | None = None) -> None:
        """Wait for the import (start phase ``imports_wait``); record its own duration as
        ``imports``; raise what it raised."""
        with timed(timeline, "imports_wait"):
            self._thread.join()
        if timeline is not None and self.seconds is not None:
            timeline.record("imports", self.seconds)
        log.info("model imports: %.2fs on their own thread", self.seconds or 0.0)
        if self._failure is not None:
            raise self._failure


_lock = threading.Lock()
_pending: ModelImports | None = None


def import_in_background(family: Family, **kwargs: Any) -> ModelImports:
    """Start importing ``family``'s pipeline class on a thread; the next
    ``join_model_imports`` (or ``wait_for_model_imports``) in this process joins it."""
    global _pending
    imports = ModelImports(family, **kwargs)
    with _lock:
        _pending = imports
    return imports.start()


def join_model_imports(timeline: StartTimeline | None = None) -> bool:
    """Join the background import if one was started and not joined yet (once: a later
    caller finds none); raise what it raised. True when there was one."""
    global _pending
    with _lock:
        pending, _pending = _pending, None
    if pending is None:
        return False
    pending.join(timeline)
    return True


def wait_for_model_imports(family: Family, timeline: StartTimeline | None = None) -> None:
    """``family``'s pipeline class imported: the background import joined if one is pending,
    else imported here as start phase ``imports`` (at once when already imported)."""
    pending = _pending
    if join_model_imports(timeline) and pending is not None and pending.family == family:
        return
    with timed(timeline, "imports"):
        import_pipeline_class(family)
