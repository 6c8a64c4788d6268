"""The scheduler's data: its view of a request, the plan of a step, what the runner did with
it, and the status changes reported back. Plain data, pure Python (no torch).

``StepScheduler`` (engine/sched/scheduler.py, which re-exports these names) makes plans and applies
outputs; the model runner reads plans and writes outputs; the engine loop carries both, and
``StepPlan`` / ``RunnerOutput`` cross process boundaries to data-parallel workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ditserve.engine.request import BatchKey, RequestStatus, SamplingParams


@dataclass(frozen=True)
class RequestWork:
    """Rows a request adds to its group's forward, and latent tokens per row."""

    rows: int
    tokens_per_row: int

    @property
    def tokens(self) -> int:
        """The request's work in a step: rows x tokens (``sched.work.WorkRule``)."""
        return self.rows * self.tokens_per_row


@dataclass
class ScheduledRequest:
    """The scheduler's view of one request: identity, status and step bookkeeping.

    arrival: the arrival counter (ties of equal priority go by it); arrived_at: the
    scheduler's clock when the request arrived (deadlines and aging count from it).
    times_paused, paused_at, paused_seconds: its preemptions (``scheduling_policy``).
    """

    request_id: str
    params: SamplingParams
    arrival: int
    work: RequestWork
    arrived_at: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    steps_done: int = 0
    times_bypassed: int = 0
    times_paused: int = 0
    paused_at: float | None = None
    paused_seconds: float = 0.0
    error: str | None = None

    @property
    def key(self) -> BatchKey:
        return self.params.batch_key()

    @property
    def total_steps(self) -> int:
        return self.params.denoise_steps  # fewer from a source image at strength < 1

    @property
    def remaining_steps(self) -> int:
        return self.total_steps - self.steps_done

    @property
    def tokens(self) -> int:
        return self.work.tokens

    @property
    def rows(self) -> int:
        return self.work.rows

    @property
    def priority(self) -> int:
        return self.params.priority

    @property
    def deadline_at(self) -> float | None:
        """The scheduler-clock time its deadline falls at, or None."""
        d = self.params.deadline_s
        return None if d is None else self.arrived_at + d


@dataclass(frozen=True)
class StepPlan:
    """What one engine step does.

    encode: admitted this step; encode them, then they join this step's denoise batch.
    denoise: every request denoised this step, in batch order (includes ``encode``); the
        runner gives each shape group among them one forward. A paused request is simply
        absent: its state waits, untouched, in the runner until a later plan lists it again.
    decode: requests whose final denoise step is this one; decode after the forward.
    freed: aborted (or deadline-stopped) requests whose runner state must be dropped.
    upcoming: the waiting requests next in the admission order after this step's admissions
        (at most ``max_num_seqs``): the runner may encode their prompts ahead, in this step's
        encoder pass (``placement.batched_encode``); nothing else is done with them.
    step_id: the scheduler's step counter; None for the idle plan, which no scheduler made.
    """

    step_id: int | None
    encode: tuple[str, ...] = ()
    denoise: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    freed: tuple[str, ...] = ()
    upcoming: tuple[str, ...] = ()

    @classmethod
    def idle(cls) -> StepPlan:
        """A plan that runs nothing: the runner only completes the steps it has queued and
        hands back their late outputs (decoded pixels). The engine sends it to flush after
        the warm-up, and as the heartbeat of an idle worker."""
        return cls(step_id=None)


@dataclass
class RunnerOutput:
    """What the model runner did with a plan (plain data: it crosses process boundaries).

    stepped: denoised this step. decoded: decode queued; the request leaves the batch.
    finished: request id -> decoded output (the runner's pixels, opaque here), for requests
    decoded this step or an earlier one. failed: request id -> error message.
    forward_*: the last step whose denoise forwards completed (0 rows: none did): its
    requests, rows, shape groups (one forward each), work (rows x tokens) and time.
    previews: request id -> (step, pixels) of a preview decoded after that step (the runner's
    pixels, opaque here; only requests with ``partial_images``); scheduling ignores them.
    step_cache_*: this step's block computations (one request through one block), those the
    step cache skipped, and the streamed bytes it did not copy (engine.step_cache).
    audio: request id -> (samples, rate) of a finished request's sound track, for the
    requests in ``finished`` that asked for one (``SamplingParams.audio``): (n, channels,
    samples) float in [-1, 1] on the CPU, ``rate`` samples per second.
    """

    stepped: list[str] = field(default_factory=list)
    decoded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    finished: dict[str, Any] = field(default_factory=dict)
    forward_requests: int = 0
    forward_rows: int = 0
    forward_groups: int = 0
    forward_tokens: int = 0
    forward_seconds: float = 0.0
    previews: dict[str, tuple[int, Any]] = field(default_factory=dict)
    step_cache_block_runs: int = 0
    step_cache_skipped_blocks: int = 0
    step_cache_skipped_bytes: int = 0
    audio: dict[str, tuple[Any, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class StatusChange:
    """A status transition reported by ``update`` (for progress events and metrics).

    resumed_after_s: on the first DENOISING change after a pause, how long it was paused.
    eta_s: on a DENOISING change, the scheduler's estimate of the seconds left (None before
        a step time was measured).
    """

    request_id: str
    status: RequestStatus
    steps_done: int
    total_steps: int
    error: str | None = None
    resumed_after_s: float | None = None
    eta_s: float | None = None
