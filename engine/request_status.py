"""The lifecycle of a request (``RequestStatus``): one ordered enum, changed only by the
scheduler. Pure Python; ``engine.request`` re-exports it.
"""

from __future__ import annotations

import enum


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Finished states sort last so ``status >= FINISHED_OK`` works.

    PAUSED: preempted at a step boundary by a request of higher priority; its denoise state
    stays with the runner, untouched, until it resumes (back to DENOISING).
    FINISHED_DEADLINE: the scheduler's estimate says it can no longer meet its ``deadline_s``
    (or the deadline passed); it was stopped at a step boundary, never silently late.
    An aborted request has no end state here: the scheduler forgets it at once (a running one
    is freed at the next step boundary) and the engine reports the abort itself.
    """

    WAITING = 0
    ENCODING = 1
    DENOISING = 2
    PAUSED = 3
    DECODING = 4
    FINISHED_OK = 5
    FINISHED_ERROR = 6
    FINISHED_DEADLINE = 7

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_OK
