"""StepScheduler: decides what every engine step does; pure Python, no torch.

One ``schedule()`` is one engine step: admit waiting requests into the running batch (they are
encoded this step), run the denoise forwards over every running request, and decode those whose
last step this is. A decoded request leaves the batch at once (its room is free for the next
step) and finishes when the runner hands back its output, which on a GPU is a step later.
``update(plan, output)`` applies what the model runner reports. Nothing else changes request
status, so the lifecycle is visible in these two methods.

A step may hold requests of any shapes: the runner gives each shape group (equal ``BatchKey``)
one forward and, under layerwise offload, runs the groups block-major so the weights cross
PCIe once per step whatever the mix. Step counts, current steps, seeds, guidance and CFG may
all differ within a group. Capacity is work, not requests: the requests of a step may take at
most ``max_batch_tokens`` rows x tokens (``RequestWork``, computed by the engine with the
model's ``WorkRule``), and at most ``max_num_seqs`` of them; a request larger than the budget
runs alone.

Admission is in arrival order with a bounded bypass: a request that fits the room left may
overtake older requests that do not (a large one waiting for running work to finish), and
each overtaking counts against every request it overtakes. Once a request has been overtaken
``max_bypass`` times nobody passes it: the step drains until it fits, and it is admitted (a
bounded wait, no starvation). The bound is checked before every overtaking, so it holds
within one admission pass too (a burst of small requests cannot all pass at once).
``max_bypass`` 0 is strict arrival order (FIFO: a request that does not fit blocks everyone
behind it).

The queue bound (``max_queue``) is replica-wide and lives in ``RankQueues``, in front of the
per-rank schedulers.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ditserve.engine.config import SchedulerConfig
from ditserve.engine.request import BatchKey, RequestStatus, SamplingParams
from ditserve.engine.work import RequestWork, WorkRule, with_budget

# The work of requests added without one (tests, warm-up): a 16-pixel-token image model.
DEFAULT_WORK_RULE = WorkRule()


@dataclass
class ScheduledRequest:
    """The scheduler's view of one request: identity, status and step bookkeeping."""

    request_id: str
    params: SamplingParams
    arrival: int
    work: RequestWork
    status: RequestStatus = RequestStatus.WAITING
    steps_done: int = 0
    times_bypassed: int = 0
    error: str | None = None

    @property
    def key(self) -> BatchKey:
        return self.params.batch_key()

    @property
    def total_steps(self) -> int:
        return self.params.num_inference_steps


@dataclass(frozen=True)
class StepPlan:
    """What one engine step does.

    encode: admitted this step; encode them, then they join this step's denoise batch.
    denoise: every request denoised this step, in batch order (includes ``encode``); the
        runner gives each shape group among them one forward.
    decode: requests whose final denoise step is this one; decode after the forward.
    freed: aborted requests whose runner state must be dropped.
    step_id: the scheduler's step counter; None for the idle plan, which no scheduler made.
    """

    step_id: int | None
    encode: tuple[str, ...] = ()
    denoise: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    freed: tuple[str, ...] = ()

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


@dataclass(frozen=True)
class StatusChange:
    """A status transition reported by ``update`` (for progress events and metrics)."""

    request_id: str
    status: RequestStatus
    steps_done: int
    total_steps: int
    error: str | None = None


class StepScheduler:
    """Continuous-batching scheduler over request ids; see the module docstring."""

    def __init__(self, config: SchedulerConfig) -> None:
        # An unresolved budget (None) budgets like an image model; the engine resolves it for
        # the served family before building its schedulers (``work.with_budget``).
        self.config = with_budget(config, None)
        self._waiting: OrderedDict[str, ScheduledRequest] = OrderedDict()
        self._running: OrderedDict[str, ScheduledRequest] = OrderedDict()
        self._decoding: dict[str, ScheduledRequest] = {}  # out of the batch, output pending
        self._aborted_running: list[str] = []
        self._arrivals = itertools.count()
        self._step_ids = itertools.count()

    # -- queries (never mutate) -------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._decoding or self._aborted_running)

    def get(self, request_id: str) -> ScheduledRequest | None:
        return (self._running.get(request_id) or self._waiting.get(request_id)
                or self._decoding.get(request_id))

    def queue_position(self, request_id: str) -> int | None:
        """0-based position among waiting requests, or None if not waiting."""
        for position, rid in enumerate(self._waiting):
            if rid == request_id:
                return position
        return None

    def waiting_ids(self) -> list[str]:
        """Waiting request ids, in queue order."""
        return list(self._waiting)

    def running_keys(self) -> set[BatchKey]:
        """The shape groups of the running batch."""
        return {request.key for request in self._running.values()}

    def committed_tokens(self) -> int:
        """Work of the running and waiting requests (rows x tokens)."""
        return sum(r.work.tokens for r in (*self._running.values(), *self._waiting.values()))

    def has_room(self, work: RequestWork) -> bool:
        """Whether a request of ``work`` fits what this rank already holds: a free slot and
        the budget left, or nothing held at all (a request larger than the budget runs
        alone, as admission lets it)."""
        queued = self.num_running + self.num_waiting
        if queued >= self.config.max_num_seqs:
            return False
        assert self.config.max_batch_tokens is not None  # resolved in __init__
        return queued == 0 or self.committed_tokens() + work.tokens <= self.config.max_batch_tokens

    # -- lifecycle inputs ------------------------------------------------------------------
    def add(self, request_id: str, params: SamplingParams,
            work: RequestWork | None = None) -> ScheduledRequest:
        """Queue a request; ``work`` from the served model's WorkRule (default: a
        16-pixel-token image model's)."""
        if request_id in self._waiting or request_id in self._running \
                or request_id in self._decoding:
            raise ValueError(f"request id {request_id!r} is already scheduled")
        request = ScheduledRequest(request_id, params, arrival=next(self._arrivals),
                                   work=work or DEFAULT_WORK_RULE.of(params))
        self._waiting[request_id] = request
        return request

    def abort(self, request_id: str) -> bool:
        """Remove a request; a running one is freed at the next step boundary."""
        if self._waiting.pop(request_id, None) is not None:
            return True
        if self._running.pop(request_id, None) is not None \
                or self._decoding.pop(request_id, None) is not None:
            self._aborted_running.append(request_id)
            return True
        return False

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        admitted = self._admit()
        decode = tuple(
            rid for rid, r in self._running.items() if r.steps_done + 1 >= r.total_steps
        )
        freed, self._aborted_running = tuple(self._aborted_running), []
        return StepPlan(
            step_id=next(self._step_ids),
            encode=tuple(admitted),
            denoise=tuple(self._running),
            decode=decode,
            freed=freed,
        )

    def update(self, plan: StepPlan, output: RunnerOutput) -> list[StatusChange]:
        """Apply the runner's results; return the status changes, finished ones last."""
        changes: list[StatusChange] = []
        for rid, message in output.failed.items():
            request = (self._running.pop(rid, None) or self._waiting.pop(rid, None)
                       or self._decoding.pop(rid, None))
            if request is not None:
                changes.append(self._set(request, RequestStatus.FINISHED_ERROR, message))
        for rid in output.stepped:
            request = self._running.get(rid)
            if request is None:  # aborted while the step ran
                continue
            request.steps_done += 1
            changes.append(self._set(request, RequestStatus.DENOISING))
        for rid in output.decoded:
            request = self._running.pop(rid, None)
            if request is not None:
                request.status = RequestStatus.DECODING
                self._decoding[rid] = request
        for rid in output.finished:
            request = self._decoding.pop(rid, None)
            if request is not None:  # None: aborted meanwhile
                changes.append(self._set(request, RequestStatus.FINISHED_OK))
        changes.sort(key=lambda c: c.status.is_finished)
        return changes

    # -- internals -------------------------------------------------------------------------
    def _set(
        self, request: ScheduledRequest, status: RequestStatus, error: str | None = None
    ) -> StatusChange:
        request.status = status
        request.error = error
        return StatusChange(
            request.request_id, status, request.steps_done, request.total_steps, error
        )

    def _admit(self) -> list[str]:
        slots = self.config.max_num_seqs - len(self._running)
        room = self.config.max_batch_tokens - sum(r.work.tokens for r in self._running.values())
        admitted: list[str] = []
        passed: list[ScheduledRequest] = []  # older requests that did not fit, in order
        for request in list(self._waiting.values()):
            if slots <= 0:
                break  # no room for any request: nobody overtakes anybody
            alone = not self._running and not admitted  # a step must admit its first request
            if request.work.tokens > room and not alone:
                if request.times_bypassed >= self.config.max_bypass:
                    break  # waited long enough: the step drains for it
                passed.append(request)
                continue
            if any(p.times_bypassed >= self.config.max_bypass for p in passed):
                break  # checked before every overtaking: the bound holds within this pass
            for p in passed:
                p.times_bypassed += 1
            self._admit_one(request)
            admitted.append(request.request_id)
            slots -= 1
            room -= request.work.tokens
        return admitted

    def _admit_one(self, request: ScheduledRequest) -> None:
        del self._waiting[request.request_id]
        request.status = RequestStatus.ENCODING
        self._running[request.request_id] = request
