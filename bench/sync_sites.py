"""Sync sites: torch's sync-debug warnings, each with the stack of the thread that raised it,
grouped by the innermost ditserve frame (shared by ``bench/step_syncs.py``).

``torch.cuda.set_sync_debug_mode("warn")`` turns every synchronizing CUDA call (a stream sync,
a synchronous copy: ``.item()``, ``.cpu()``, a blocking H2D copy, ``nonzero``) into a Python
warning raised in the thread that made the call. ``SyncCapture`` records each one with that
thread's stack; ``group_sites`` turns the records into one row per call site.
"""

from __future__ import annotations

import importlib.util
import inspect
import linecache
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's sync-debug warning


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    function: str
    text: str = ""


@dataclass(frozen=True)
class SyncRecord:
    thread: str
    frames: tuple[Frame, ...]  # outermost first; the innermost made the synchronizing call


class SyncCapture:
    """While entered, records every sync-debug warning with the stack of the thread that
    raised it (the warnings module calls ``showwarning`` in that thread); other warnings go
    on to the handler that was installed before."""

    def __init__(self, *, stacks: bool = True) -> None:
        """stacks=False: count the warnings per thread and walk no stack (their records
        have no frames), to tell torch's own cost of warning from this handler's."""
        self.stacks = stacks
        self.records: list[SyncRecord] = []
        self.intact = True  # False: something replaced the handler while it was entered
        # Seconds spent in this handler: under sync-debug mode full-size steps took 23-36 s
        # (2026-12-06); this says how much of that is the recording, and how much is torch's.
        self.handler_s = 0.0
        self._lock = threading.Lock()
        self._stacks: dict[tuple[tuple[str, int, str], ...], tuple[Frame, ...]] = {}
        self._guard = warnings.catch_warnings()  # puts the filters and handler back on exit
        self._handler = self._show
        self._previous: Callable[..., Any] = warnings.showwarning

    def __enter__(self) -> SyncCapture:
        self._guard.__enter__()
        # Every occurrence, not once per call site: the counts are the point.
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")
        self._previous = warnings.showwarning
        warnings.showwarning = self._handler
        return self

    def __exit__(self, *exc: object) -> None:
        self.intact = warnings.showwarning is self._handler
        self._guard.__exit__(None, None, None)

    def _show(self, message: Warning | str, category: type[Warning], filename: str,
              lineno: int, file: Any = None, line: str | None = None) -> None:
        if SYNC_MESSAGE not in str(message):
            self._previous(message, category, filename, lineno, file, line)
            return
        started = time.perf_counter()
        if not self.stacks:
            with self._lock:
                self.records.append(SyncRecord(threading.current_thread().name, ()))
                self.handler_s += time.perf_counter() - started
            return
        # A step can warn thousands of times; reading source lines for each one made steps
        # take seconds (2026-12-06, H100). Key each stack by its raw frames (no line text) and
        # build the Frame tuple, with text, once per distinct stack.
        here = inspect.currentframe()
        caller = here.f_back if here is not None else None  # skip this handler's own frame
        raw = [(f.f_code.co_filename, lineno, f.f_code.co_name)
               for f, lineno in traceback.walk_stack(caller)][::-1]
        while raw and raw[-1][0] == warnings.__file__:  # warnings' own frames
            raw.pop()
        key = tuple(raw)
        with self._lock:
            frames = self._stacks.get(key)
            if frames is None:
                frames = tuple(Frame(path, line, name, linecache.getline(path, line).strip())
                               for path, line, name in key)
                self._stacks[key] = frames
            self.records.append(SyncRecord(threading.current_thread().name, frames))
            self.handler_s += time.perf_counter() - started

    @property
    def count(self) -> int:
        """The sync-debug warnings recorded so far."""
        with self._lock:
            return len(self.records)


def package_roots() -> list[Path]:
    """The folders of ditserve's top-level packages (engine, cachectl, operator)."""
    roots = []
    for name in ("ditserve.engine", "ditserve.cachectl", "ditserve.operator"):
        spec = importlib.util.find_spec(name)
        roots += [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return roots


def shown(frame: Frame, roots: Sequence[Path]) -> str | None:
    """``engine/runner/inflight.py:123 wait`` for a frame in ditserve, else None."""
    for root in roots:
        if frame.path.startswith(f"{root}/"):
            return f"{Path(frame.path).relative_to(root.parent)}:{frame.line} {frame.function}"
    return None


def group_sites(records: Sequence[SyncRecord], roots: Sequence[Path],
                steps: int) -> list[dict[str, Any]]:
    """One row per synchronizing site (the innermost ditserve frame), most frequent first:
    count, rate per step, threads, one example's ditserve-only stack and its innermost
    frame (the call that synchronized, maybe in torch or diffusers)."""
    sites: dict[str, dict[str, Any]] = {}
    for record in records:
        ours = [s for s in (shown(f, roots) for f in record.frames) if s is not None]
        innermost = record.frames[-1] if record.frames else Frame("?", 0, "?")
        callee = f"{Path(*Path(innermost.path).parts[-3:])}:{innermost.line} " \
                 f"{innermost.function}" + (f": {innermost.text}" if innermost.text else "")
        key = ours[-1] if ours else f"(no ditserve frame) {callee}"
        site = sites.setdefault(key, {"site": key, "count": 0, "threads": [],
                                      "stack": ours, "callee": callee})
        site["count"] += 1
        if record.thread not in site["threads"]:
            site["threads"].append(record.thread)
    rows = sorted(sites.values(), key=lambda s: (-s["count"], s["site"]))
    for row in rows:
        row["per_step"] = row["count"] / steps if steps else None
    return rows
