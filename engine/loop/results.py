"""What the engine hands back: results, progress events, request handles, stats, observers.

Plain types shared by the engine loop (engine.py), the HTTP layer and the benchmarks. They
know nothing of the engine: a handle cancels through the abort function it was given.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

from ditserve.engine.request import SamplingParams


@dataclass(frozen=True)
class GenerationResult:
    """A finished request. ``pixels`` is (n, 3, H, W) float in [0, 1] on CPU for an image
    model, (n, F, 3, H, W) for a video model (n videos of F frames; ``engine.media.video`` writes
    them as MP4). ``audio``: the videos' sound tracks where the request asked for them
    (``SamplingParams.audio``), (n, channels, samples) float in [-1, 1] on CPU at
    ``audio_rate`` samples per second; None otherwise.

    ``images`` (PIL) are made from the pixels on first use (a one-frame video's too: its
    frames, a video model's still images), in the caller's thread: converting
    a 1024x1024 image takes tens of milliseconds, which the engine loop would otherwise spend
    between two steps with the GPU idle.
    """

    request_id: str
    pixels: Any
    seed: int
    num_inference_steps: int
    queue_seconds: float
    latency_seconds: float
    rank: int = 0  # the data-parallel rank that generated it
    audio: Any = None
    audio_rate: int = 0

    @property
    def num_images(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def is_video(self) -> bool:
        return int(self.pixels.dim()) == 5

    @cached_property
    def images(self) -> list[Any]:
        from ditserve.engine.media.images import to_pil_images

        return to_pil_images(self.pixels)


@dataclass(frozen=True)
class RequestEvent:
    """Progress of one request. kind: queued | step | paused | preview | finished | failed |
    aborted. A "step" event carries ``eta_s``, the scheduler's estimate of the seconds left
    (None before a step time was measured); "paused" means preempted at a step boundary by a
    higher-priority request (it resumes on its own).

    A "preview" event carries ``pixels``, (n, 3, H, W) float in [0, 1] on the CPU: the
    request's latents decoded after ``step`` (asked for with ``partial_images``).
    """

    request_id: str
    kind: str
    step: int = 0
    total_steps: int = 0
    queue_position: int | None = None
    error: str | None = None
    pixels: Any = None
    eta_s: float | None = None


class EngineObserver(Protocol):
    """Receives engine-wide measurements (the HTTP server turns them into metrics)."""

    def on_step(self, *, requests: int, rows: int, seconds: float, groups: int = 1,
                tokens: int = 0) -> None:
        """A step's denoise forwards completed: ``groups`` shape groups (one forward each)
        over ``requests`` requests, ``rows`` rows and ``tokens`` rows x latent tokens, in
        ``seconds`` (GPU time on CUDA)."""
    def on_finished(self, result: GenerationResult) -> None: ...
    def on_failed(self, request_id: str, reason: str) -> None: ...

    # Optional (called only when an observer defines them): a request was paused at a step
    # boundary for a higher-priority one (on_preempted), a paused one resumed after
    # ``seconds`` (on_resumed), a request was stopped or refused for its deadline.
    # def on_preempted(self, request_id: str) -> None
    # def on_resumed(self, request_id: str, seconds: float) -> None
    # def on_deadline_exceeded(self, request_id: str) -> None


@dataclass
class RequestHandle:
    """A submitted request: wait on ``future`` or ``result()``; ``cancel()`` aborts it.

    abort_fn: the engine's ``abort(request_id)``; True if the request was still pending.
    """

    request_id: str
    params: SamplingParams
    seed: int
    future: concurrent.futures.Future[GenerationResult]
    abort_fn: Callable[[str], bool]
    on_event: Callable[[RequestEvent], None] | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    queue_position: int | None = None  # the last one reported in a "queued" event

    def result(self, timeout: float | None = None) -> GenerationResult:
        return self.future.result(timeout)

    def cancel(self) -> bool:
        return self.abort_fn(self.request_id)


@dataclass(frozen=True)
class EngineStats:
    """Counters of a replica. paused: requests preempted at a step boundary;
    waiting_high_priority: waiting requests of a priority below the default 0;
    step_seconds: the schedulers' measured busy-step period (the slowest rank's; None before
    any was measured), what deadline estimates use."""

    running: int
    waiting: int
    steps_run: int
    rows_run: int
    requests_finished: int
    ranks: int = 1
    paused: int = 0
    waiting_high_priority: int = 0
    step_seconds: float | None = None
    step_cache_block_runs: int = 0  # block computations (one request through one block)
    step_cache_skipped_blocks: int = 0  # of those, skipped by the step cache
    step_cache_skipped_bytes: int = 0  # streamed block bytes not copied (DLO)
    # The oldest step on the executor now (None: none), and the requests its steps denoise -
    # aborted ones included: a step is never cut short, so they still cost until it ends.
    step_in_flight_s: float | None = None
    requests_in_flight: int = 0

    @property
    def step_cache_skipped_fraction(self) -> float:
        runs = self.step_cache_block_runs
        return self.step_cache_skipped_blocks / runs if runs else 0.0

    @property
    def mean_batch_rows(self) -> float:
        return self.rows_run / self.steps_run if self.steps_run else 0.0
