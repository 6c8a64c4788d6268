"""ThreadSamples: where each thread of the process was, sampled, to name time between steps.

The step log (DEBUG) says when a step's wall time exceeds its forward and its encode/decode;
it cannot say what filled the rest, because that is whatever held the loop thread or the
interpreter: planning under the engine's lock, HTTP handlers parsing requests, responses
being encoded, the garbage collector, a blocking call in a library. This sampler reads every
thread's innermost frame (``sys._current_frames``) every ``interval_s`` and keeps the last
``keep_s`` seconds, so a slow gap between two steps can be described afterwards by where each
thread was during it (issue 47's priority run lost 0.3-1.9 s at a time between forwards).

Sampling takes the interpreter lock for well under a millisecond every 10 ms; it runs only
while the step log is at DEBUG (``ditserve -v serve``) and the engine is stepping: the step log
keeps it running at each step, and it stops by itself ``keep_s`` after the last one.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

# Innermost functions where a thread is parked, not working (its samples read "idle").
IDLE_FUNCTIONS = frozenset({"wait", "select", "poll", "epoll", "get", "sleep", "_worker",
                            "accept", "recv", "recv_into", "readinto", "run_forever"})


def short_path(filename: str) -> str:
    """A file name as a reader finds it: from the package folder on (``ditserve/...``,
    ``torch/...`` under site-packages), else the base name."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    for marker in ("/ditserve/", "/engine/", "/cachectl/"):
        if marker in filename:
            return marker.strip("/") + "/" + filename.rsplit(marker, 1)[1]
    return filename.rsplit("/", 1)[-1]


def is_ours(filename: str) -> bool:
    """A file of ditserve's own (installed as ``ditserve/``, or a checkout's folders)."""
    if "/ditserve/" in filename:
        return True
    return "-packages/" not in filename and ("/engine/" in filename or "/cachectl/" in filename)


def where(frame: FrameType) -> str:
    """``file:function:line`` of the innermost frame, with the nearest frame of ditserve's
    own code beside it when the innermost is a library's (what ditserve was calling)."""
    code = frame.f_code
    inner = f"{short_path(code.co_filename)}:{code.co_name}:{frame.f_lineno}"
    if code.co_name in IDLE_FUNCTIONS:
        return "idle"
    outer: FrameType | None = frame
    while outer is not None:
        name = outer.f_code.co_filename
        if is_ours(name):
            if outer is frame:
                return inner
            return f"{inner} < {short_path(name)}:{outer.f_code.co_name}:{outer.f_lineno}"
        outer = outer.f_back
    return inner


class ThreadSamples:
    """Samples every thread's position on a daemon thread of its own (module docstring)."""

    def __init__(self, interval_s: float = 0.01, keep_s: float = 10.0, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.keep_s = keep_s
        self._clock = clock
        self._samples: collections.deque[tuple[float, tuple[tuple[str, str], ...]]] = \
            collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_wanted = 0.0  # time.monotonic() of the last keep_running

    def keep_running(self) -> None:
        """Sample on a daemon thread until ``stop``, or until this has not been called for
        ``keep_s`` (the step log calls it at each step, so an idle engine is not sampled)."""
        self._last_wanted = time.monotonic()
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="ditserve-thread-samples",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if time.monotonic() - self._last_wanted > self.keep_s:
                return  # idle: the next step starts it again
            self.sample()

    def sample(self) -> None:
        """Record where every thread but the sampler's own is now."""
        now = self._clock()
        own = self._thread.ident if self._thread is not None else None
        names = {t.ident: t.name for t in threading.enumerate()}
        at = tuple(sorted((names.get(ident, str(ident)), where(frame))
                          for ident, frame in sys._current_frames().items() if ident != own))
        with self._lock:
            self._samples.append((now, at))
            while self._samples and self._samples[0][0] < now - self.keep_s:
                self._samples.popleft()

    def between(self, start: float, end: float) -> dict[str, collections.Counter[str]]:
        """Per thread name: how many samples in [start, end] found it at each place."""
        with self._lock:
            samples = [at for t, at in self._samples if start <= t <= end]
        counts: dict[str, collections.Counter[str]] = {}
        for at in samples:
            for thread, place in at:
                counts.setdefault(thread, collections.Counter())[place] += 1
        return counts

    def describe(self, start: float, end: float, top: int = 3) -> str:
        """One line per busy thread: its most sampled places in [start, end], with the share
        of the samples each took; threads idle throughout are left out."""
        counts = self.between(start, end)
        lines = []
        for thread in sorted(counts):
            places = counts[thread]
            total = sum(places.values())
            busy = [(place, n) for place, n in places.most_common() if place != "idle"]
            if not busy:
                continue
            shown = ", ".join(f"{100 * n / total:.0f}% {place}" for place, n in busy[:top])
            lines.append(f"{thread} ({total} samples): {shown}")
        return "; ".join(lines) if lines else "every thread idle"
