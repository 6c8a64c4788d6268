"""StepScheduler: decides what every engine step does; pure Python, no torch.

One ``schedule()`` is one engine step: admit waiting requests into the running batch (encoded
this step), run the denoise forwards over every running request, and decode those whose last
step this is (a decoded request leaves the batch at once and finishes when the runner hands
back its output, on a GPU a step later). ``update(plan, output)`` applies what the runner
reports; nothing else changes request status, so the lifecycle is visible in these two methods.
A plan also names the waiting requests next in line (``upcoming``), whose prompts the runner may
encode ahead in the step's encoder pass; that changes no status.

A step may hold requests of any shapes: the runner gives each shape group (equal ``BatchKey``) one
forward and, under layerwise offload, runs the groups block-major so the weights cross PCIe once
per step whatever the mix. Step counts, current steps, seeds, guidance and CFG may all differ
within a group. Capacity is work, not requests: the requests of a step may take at most
``max_batch_tokens`` rows x tokens (``RequestWork``, computed by the engine with the model's
``WorkRule``), and at most ``max_num_seqs`` of them; a request larger than the budget runs alone.
At most ``max_loras`` distinct LoRA adapters (``AdapterRoom``): the others wait as if over budget.

Admission is in arrival order with a bounded bypass: a request that fits the room left may
overtake older ones that do not; each overtaking counts against every request overtaken, and
once one has been overtaken ``max_bypass`` times nobody passes it: the step drains until it
fits (bounded wait, no starvation), a bound checked before every overtaking (a burst of small
requests cannot all pass at once). ``max_bypass`` 0 is strict FIFO.

Under the "priority" policy lower-priority running requests may be paused at a step boundary
(and those beyond ``urgent_companions`` beside an urgent one): left out of the plans, their
state kept, until resumed without a second encode. Under both policies a request that can no
longer meet its deadline ends as FINISHED_DEADLINE at a step boundary; ``update()`` reports the
pauses and deadline stops of the ``schedule()`` before it. ``max_queue`` lives in ``RankQueues``.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from ditserve.engine.adapters.admission import AdapterRoom
from ditserve.engine.request import BatchKey, RequestStatus, SamplingParams
from ditserve.engine.sched.deadlines import StepClock, finish_steps, late_by
from ditserve.engine.sched.policy import AdmissionOrder, admission_order
from ditserve.engine.sched.work import ResolvedScheduling, WorkRule
from ditserve.engine.step.plan import (
    RequestWork,
    RunnerOutput,
    ScheduledRequest,
    StatusChange,
    StepPlan,
)

__all__ = ["DEFAULT_WORK_RULE", "StepScheduler"]

# The work of requests added without one (tests, warm-up): a 16-pixel-token image model.
DEFAULT_WORK_RULE = WorkRule()
NEWEST = 2**62  # the arrival counter of a request not yet added (an estimate's)


class StepScheduler:
    """Continuous-batching scheduler over request ids; see the module docstring. ``clock``:
    monotonic seconds (deadlines, aging, the measured step time); tests inject one."""

    def __init__(self, config: ResolvedScheduling, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(config, ResolvedScheduling):
            # The budget depends on the served family, which only the engine knows.
            raise TypeError("StepScheduler needs a ResolvedScheduling (resolve the "
                            "SchedulerConfig with ResolvedScheduling.for_family)")
        self.config = config
        self.clock = clock
        self._order = admission_order(config)
        self._waiting: OrderedDict[str, ScheduledRequest] = OrderedDict()
        self._running: OrderedDict[str, ScheduledRequest] = OrderedDict()
        self._paused: OrderedDict[str, ScheduledRequest] = OrderedDict()
        self._decoding: dict[str, ScheduledRequest] = {}  # out of the batch, output pending
        self._aborted_running: list[str] = []
        self._reported: list[StatusChange] = []  # made by schedule(), reported by update()
        self._step_clock = StepClock()
        self._arrivals = itertools.count()
        self._step_ids = itertools.count()

    # -- queries (never mutate) -------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_paused(self) -> int:  # preempted, state kept by the runner
        return len(self._paused)

    @property
    def step_seconds(self) -> float | None:
        """The measured period of a busy step (None until two busy steps were planned)."""
        return self._step_clock.step_s

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._paused or self._decoding
                    or self._aborted_running)

    def get(self, request_id: str) -> ScheduledRequest | None:
        return (self._running.get(request_id) or self._waiting.get(request_id)
                or self._paused.get(request_id) or self._decoding.get(request_id))

    def queue_position(self, request_id: str) -> int | None:
        """0-based position among waiting requests (admission order); None: not waiting."""
        return self.waiting_ids().index(request_id) if request_id in self._waiting else None

    def waiting_ids(self) -> list[str]:
        """Waiting request ids, in admission order."""
        return [r.request_id for r in self._order.order(self._waiting.values(), self.clock())]

    def waiting_priorities(self) -> list[int]:
        return [r.priority for r in self._waiting.values()]  # queue depth by class (metrics)

    def running_keys(self) -> set[BatchKey]:
        """The shape groups of the running batch."""
        return {request.key for request in self._running.values()}

    def committed_tokens(self) -> int:
        """Work of the running, paused and waiting requests (rows x tokens)."""
        return sum(r.work.tokens for r in self._held())

    def has_room(self, work: RequestWork) -> bool:
        """Whether a request of ``work`` fits what this rank already holds: a free slot and
        the budget left, or nothing held at all (a request larger than the budget runs
        alone, as admission lets it)."""
        queued = self.num_running + self.num_waiting + self.num_paused
        if queued >= self.config.max_num_seqs:
            return False
        return queued == 0 or self.committed_tokens() + work.tokens <= self._budget

    @property
    def order(self) -> AdmissionOrder:
        return self._order

    def pausable_priority(self, params: SamplingParams) -> int | None:
        """The priority of the first request paused here for one of ``params``, or None."""
        probe = ScheduledRequest("", params, NEWEST, DEFAULT_WORK_RULE.of(params))
        victims = self._order.victims(
            list(self._running.values()), probe, tokens_short=0, slots_short=1)
        return victims[0].priority if victims else None

    def estimate_s(self, params: SamplingParams, work: RequestWork | None = None
                   ) -> float | None:
        """Seconds a new request would take to finish here (``deadlines.finish_steps`` at the
        measured step time); None before a step time was measured."""
        step_s = self.step_seconds
        if step_s is None:
            return None
        now = self.clock()
        new = ScheduledRequest("", params, arrival=NEWEST,
                               work=work or DEFAULT_WORK_RULE.of(params), arrived_at=now)
        return finish_steps(new, self._ahead_of(new, now), self._budget) * step_s

    # -- lifecycle inputs ------------------------------------------------------------------
    def add(self, request_id: str, params: SamplingParams,
            work: RequestWork | None = None, *, arrived_at: float | None = None
            ) -> ScheduledRequest:
        """Queue a request; ``work`` from the served model's WorkRule (default: a
        16-pixel-token image model's); ``arrived_at``: when it reached the replica, on this
        scheduler's clock (default now; its deadline counts from it)."""
        if self.get(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already scheduled")
        request = ScheduledRequest(
            request_id, params, arrival=next(self._arrivals),
            work=work or DEFAULT_WORK_RULE.of(params),
            arrived_at=self.clock() if arrived_at is None else arrived_at)
        self._waiting[request_id] = request
        return request

    def abort(self, request_id: str) -> bool:
        """Remove a request; a running or paused one is freed at the next step boundary."""
        if self._waiting.pop(request_id, None) is not None:
            return True
        if any(queue.pop(request_id, None) is not None
               for queue in (self._running, self._paused, self._decoding)):
            self._aborted_running.append(request_id)
            return True
        return False

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        now = self.clock()
        self._stop_late(now)
        admitted, considered = self._admit(now)
        decode = tuple(rid for rid, r in self._running.items() if r.remaining_steps <= 1)
        freed, self._aborted_running = tuple(self._aborted_running), []
        self._step_clock.tick(now, busy=bool(self._running))
        # The next step's likely admissions, whose prompts the runner may encode ahead: the
        # ones still waiting, in the order admission just walked (no second sort).
        upcoming = [r for r in considered if r.request_id in self._waiting]
        upcoming = upcoming[: self.config.max_num_seqs]
        return StepPlan(step_id=next(self._step_ids), encode=tuple(admitted),
                        denoise=tuple(self._running), decode=decode, freed=freed,
                        upcoming=tuple(r.request_id for r in upcoming))

    def update(self, plan: StepPlan, output: RunnerOutput) -> list[StatusChange]:
        """Apply the runner's results; return the status changes (with the pauses, resumes
        and deadline stops of ``plan``), finished ones last."""
        changes, self._reported = self._reported, []
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
            changes.append(self._stepped(request))
        for rid in output.decoded:
            request = self._running.pop(rid, None)
            if request is not None:
                request.status = RequestStatus.DECODING
                self._decoding[rid] = request
        for rid in output.finished:
            request = self._decoding.pop(rid, None)
            if request is not None:  # None: aborted meanwhile
                changes.append(self._set(request, RequestStatus.FINISHED_OK))
        if not self.has_work():
            self._step_clock.tick(self.clock(), busy=False)  # idle time is no step period
        changes.sort(key=lambda c: c.status.is_finished)
        return changes

    # -- internals -------------------------------------------------------------------------
    @property
    def _budget(self) -> int:
        return self.config.max_batch_tokens

    def _held(self) -> Iterable[ScheduledRequest]:
        return (*self._running.values(), *self._paused.values(), *self._waiting.values())

    def _ahead_of(self, new: ScheduledRequest, now: float) -> list[ScheduledRequest]:
        """The requests that go before ``new``, by the policy."""
        return self._order.ahead_of(new, self._running.values(),
                                    (*self._paused.values(), *self._waiting.values()), now)

    def _set(self, request: ScheduledRequest, status: RequestStatus,
             error: str | None = None) -> StatusChange:
        request.status, request.error = status, error
        return StatusChange(request.request_id, status, request.steps_done,
                            request.total_steps, error)

    def _stepped(self, request: ScheduledRequest) -> StatusChange:
        resumed_after = None
        if request.paused_at is not None:  # its first step since it resumed
            resumed_after, request.paused_at = request.paused_seconds, None
        request.status = RequestStatus.DENOISING
        step_s = self.step_seconds
        return StatusChange(
            request.request_id, RequestStatus.DENOISING, request.steps_done,
            request.total_steps, resumed_after_s=resumed_after,
            eta_s=None if step_s is None else request.remaining_steps * step_s)

    def _stop_late(self, now: float) -> None:
        """Finish every held request that can no longer meet its deadline (``late_by``)."""
        for queue in (self._waiting, self._paused, self._running):
            for rid, request in list(queue.items()):
                reason = late_by(request, now, self.step_seconds)
                if reason is None:
                    continue
                del queue[rid]
                if queue is not self._waiting:
                    self._aborted_running.append(rid)  # the runner drops its state
                self._reported.append(self._set(request, RequestStatus.FINISHED_DEADLINE,
                                                reason))

    def _admit(self, now: float) -> tuple[list[str], list[ScheduledRequest]]:
        """Waiting and paused requests in the policy's order, with the bounded bypass (see
        the module docstring); a policy that preempts pauses lower-ranked running requests
        for one that does not fit. Adapters never pause anybody: a request whose adapters do
        not fit beside the running and paused ones waits as if over budget. Returns the
        admitted ids and every request considered, in that order."""
        slots = self.config.max_num_seqs - len(self._running)
        room = self._budget - sum(r.work.tokens for r in self._running.values())
        admitted: list[str] = []
        joined: set[str] = set()  # admitted or resumed in this pass: never paused by it
        passed: list[ScheduledRequest] = []  # requests that did not fit, in order
        bound = self.config.max_bypass
        adapters = AdapterRoom(self.config.max_loras, self._running.values(), self._paused.values())
        considered = self._order.order((*self._paused.values(), *self._waiting.values()), now)
        for request in considered:
            alone = not self._running  # a step must admit its first request
            adapters_fit = adapters.fits(request) or (alone and not self._paused)
            fits = slots > 0 and (alone or request.work.tokens <= room) and adapters_fit
            if not fits and adapters_fit and not any(p.times_bypassed >= bound for p in passed):
                pausable = [r for r in self._running.values() if r.request_id not in joined]
                victims = self._order.victims(pausable, request, tokens_short=request.tokens
                                              - room, slots_short=1 - slots)
                for victim in victims or ():
                    self._pause(victim, now)
                    slots, room, fits = slots + 1, room + victim.tokens, True
            if fits and not self._order.companion_fits(self._running.values(), request):
                continue  # an urgent request runs with few rows beside it: this one waits
            if not fits:
                if slots <= 0 or request.times_bypassed >= bound:
                    break  # no room for anybody, or it waited long enough: drain for it
                passed.append(request)
                continue
            if any(p.times_bypassed >= bound for p in passed):
                break  # checked before every overtaking: the bound holds within this pass
            for p in passed:
                p.times_bypassed += 1
            if request.request_id in self._paused:
                self._resume(request, now)
            else:
                self._admit_one(request)
                admitted.append(request.request_id)
            joined.add(request.request_id)
            slots, room = slots - 1, room - request.work.tokens
            adapters.take(request)
            for victim in self._order.excess_companions(self._running.values(), request, joined):
                self._pause(victim, now)
                slots, room = slots + 1, room + victim.tokens
        return admitted, considered

    def _admit_one(self, request: ScheduledRequest) -> None:
        del self._waiting[request.request_id]
        request.status = RequestStatus.ENCODING
        self._running[request.request_id] = request

    def _pause(self, request: ScheduledRequest, now: float) -> None:
        self._paused[request.request_id] = self._running.pop(request.request_id)
        request.times_paused, request.paused_at = request.times_paused + 1, now
        self._reported.append(self._set(request, RequestStatus.PAUSED))

    def _resume(self, request: ScheduledRequest, now: float) -> None:
        self._running[request.request_id] = self._paused.pop(request.request_id)
        assert request.paused_at is not None
        request.paused_seconds, request.status = now - request.paused_at, RequestStatus.DENOISING
