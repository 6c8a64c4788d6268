"""JobWorker: one replica's hands on the shared job queue - it claims jobs when its engine
has room, runs them, keeps their leases, and writes their results.

A thread (``ditserve-video-jobs``) loops: it writes the progress reported since its last
turn, renews its leases every third of a lease (letting go of a job cancelled, deleted or
taken over: the engine request is aborted), retries the writes the store refused while
unreachable, then claims jobs while running + waiting < ``max_num_seqs`` (on a local store
plus ``PREFETCH``, waiting in the engine for the next free slot; shared, an idle replica takes
it). It wakes when a job is created here or a slot frees, else every ``poll_s``.

A claimed job is an ordinary engine request (its id is the job id). Progress: a local store
(SQLite) is written from the engine's loop thread at each step (followers hear steps in
order); a shared one from this thread at most every ``PROGRESS_S``, so a slow or unreachable
Redis never stalls the step loop. A finished request's MP4 is encoded and published by an
encoding thread, which completes the job (the first result of any claim wins); every other
end is written from those threads too: ``generation_failed``, ``deadline_exceeded``,
``encoding_failed``, ``storage_full`` / ``storage_error``, or a hand-back to the queue of a
job the engine dropped (it stops) or could not take. With the store unreachable, running
jobs go on and their results wait here until it is back. Built and driven by ``VideoJobs``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ditserve.engine.errors import (
    DeadlineError,
    EngineStoppedError,
    InvalidRequestError,
    QueueFullError,
    RequestAborted,
)
from ditserve.engine.loop.client import EngineClient
from ditserve.engine.loop.lifecycle import EnginePhase
from ditserve.engine.server.jobs.errors import StorageError, StoreUnavailable
from ditserve.engine.server.jobs.model import JobStatus, VideoJob, VideoSpec
from ditserve.engine.server.jobs.store import JobStore

log = logging.getLogger(__name__)

ENCODE_THREADS = 2  # libx264 threads internally; two jobs may encode while others denoise
POLL_S = 0.2  # how often an idle replica looks for jobs created elsewhere
PREFETCH = 1  # a lone replica claims one job beyond its slots: it waits in the engine
PROGRESS_S = 0.25  # a shared store gets a job's progress at most this often
UNREACHABLE_LOG_S = 10.0  # one warning per this long while the store is unreachable


@dataclass
class Held:
    """A job this replica claimed: its claim's token; whether the engine runs it now."""

    token: str
    spec: VideoSpec
    in_engine: bool = False


class JobWorker:
    """See the module docstring."""

    def __init__(self, engine: EngineClient, store: JobStore, *, lease_s: float,
                 poll_s: float = POLL_S, encode_threads: int = ENCODE_THREADS) -> None:
        self.engine = engine
        self.store = store
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._lock = threading.Lock()
        self._held: dict[str, Held] = {}
        self._progress: dict[str, tuple[int, float | None]] = {}
        self._unwritten: list[Callable[[], None]] = []  # results the store refused
        self._claiming = True
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_unreachable = 0.0
        self._progress_written = 0.0
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=encode_threads, thread_name_prefix="ditserve-video-encode")
        self._thread = threading.Thread(target=self._run, name="ditserve-video-jobs",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop_claiming(self) -> None:
        """Draining: take no new job; the ones held finish (or are handed back at stop)."""
        self._claiming = False

    def busy(self) -> bool:
        """Whether this replica holds a job or an unwritten result (the drain waits)."""
        with self._lock:
            return bool(self._held or self._unwritten)

    def let_go(self, job_id: str, reason: str) -> None:
        """Stop running a job this replica holds (cancelled, deleted, taken over)."""
        with self._lock:
            held = self._held.pop(job_id, None)
        if held is not None and held.in_engine:
            self.engine.abort(job_id, reason)
        self.wake()

    def close(self) -> None:
        """After the engine stopped: finish the encodes under way, write what can be
        written, hand back what is left, stop the thread."""
        self._claiming = False
        self._pool.shutdown(wait=True)
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        self._write_unwritten()
        with self._lock:
            left, self._held = self._held, {}
            lost = len(self._unwritten)
        for job_id, held in left.items():
            try:
                self.store.hand_back(job_id, held.token)
            except StoreUnavailable as e:
                self._unreachable(e)
        if lost:
            log.error("%d video result(s) could not be written: the job store stayed "
                      "unreachable (their jobs run again elsewhere once their leases expire)",
                      lost)

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        renewed = 0.0
        while not self._stop.is_set():
            try:
                self._write_progress()
                if time.monotonic() - renewed >= self.lease_s / 3:
                    self._renew()
                    renewed = time.monotonic()
                self._write_unwritten()
                while self._has_room():
                    job = self.store.claim(self.owner, self.lease_s)
                    if job is None or not self._begin(job):
                        break
            except StoreUnavailable as e:
                self._unreachable(e)
            except Exception:
                log.exception("video job worker: unexpected error (it goes on)")
            self._wake.wait(self.poll_s)
            self._wake.clear()

    def _has_room(self) -> bool:
        if not self._claiming or self.engine.phase is not EnginePhase.READY:
            return False
        slots = self.engine.config.scheduler.max_num_seqs
        stats = self.engine.stats()
        with self._lock:
            in_engine = sum(h.in_engine for h in self._held.values())
        prefetch = 0 if self.store.shared else PREFETCH  # replicas share: idle ones take it
        return max(in_engine, stats.running + stats.waiting) < slots + prefetch

    def _begin(self, job: VideoJob) -> bool:
        """Run a claimed job; False: the engine took no more (claim nothing else now)."""
        token = job.token
        assert token is not None  # a claimed job has its claim's token
        with self._lock:
            mine = self._held.get(job.id)
            if mine is not None:  # our own lease ran out (store unreachable): keep running
                mine.token = token
                return True
            held = self._held[job.id] = Held(token, job.spec, in_engine=True)
        try:
            handle = self.engine.add_request(job.params_at(self.store.clock()), request_id=job.id,
                                             on_event=partial(self._on_event, job.id))
        except (QueueFullError, EngineStoppedError):
            self._forget(job.id)
            self.store.hand_back(job.id, token)
            return False
        except (InvalidRequestError, DeadlineError) as e:
            self._forget(job.id)
            code, text = (("deadline_exceeded", str(e)) if isinstance(e, DeadlineError) else
                          ("invalid_request", f"this replica cannot run the job: {e}"))
            self.store.fail(job.id, code, text, token=token)  # a deadline is the job's own
            return True
        except Exception as e:  # anything else would recur on every claim: fail the job
            log.exception("video %s: the engine refused it", job.id)
            self._forget(job.id)
            self.store.fail(job.id, "generation_failed", f"the engine refused this job ({e}); "
                            "see the server log", token=token)
            return True
        # The callback first: whatever happens to the store now, the result is handled.
        handle.future.add_done_callback(partial(self._on_done, job.id, held))
        if not self.store.started(job.id, token, seed=handle.seed):
            self.let_go(job.id, "cancelled")  # a DELETE (or a take-over) came first
        return True

    def _write_progress(self) -> None:
        self._progress_written = time.monotonic()
        with self._lock:
            progress, self._progress = self._progress, {}
            tokens = {job_id: self._held[job_id].token for job_id in progress
                      if job_id in self._held}
        for job_id, token in tokens.items():
            steps, eta = progress[job_id]
            self.store.stepped(job_id, token, steps, eta)

    def _renew(self) -> None:
        with self._lock:
            held = [(job_id, h.token) for job_id, h in self._held.items()]
        for job_id, token in held:
            job = self.store.renew(job_id, token, self.lease_s)
            if job is None or job.status.is_finished or job.token != token:
                gone = job is None or job.status is JobStatus.CANCELLED
                self.let_go(job_id, "cancelled" if gone else "taken over by another replica")

    def _write_unwritten(self) -> None:
        with self._lock:
            waiting, self._unwritten = self._unwritten, []
        for i, write in enumerate(waiting):
            try:
                write()
            except StoreUnavailable:
                with self._lock:
                    self._unwritten[:0] = waiting[i:]
                raise

    def _unreachable(self, error: Exception) -> None:
        now = time.monotonic()
        if now - self._last_unreachable >= UNREACHABLE_LOG_S:
            self._last_unreachable = now
            log.warning("%s; running jobs go on, results are written when it is back", error)

    def _forget(self, job_id: str, held: Held | None = None) -> None:  # only ``held``'s claim
        with self._lock:
            if held is None or self._held.get(job_id) is held:
                self._held.pop(job_id, None)

    def _settle(self, job_id: str, held: Held, write: Callable[[], None]) -> None:
        """Write a job's end now, or (store unreachable) as soon as it is back."""
        def once() -> None:
            write()
            with self._lock:
                if self._held.get(job_id) is held:
                    del self._held[job_id]

        try:
            once()
        except StoreUnavailable as e:
            self._unreachable(e)
            with self._lock:
                self._unwritten.append(once)
        except Exception:  # never keep a job held (the drain would wait on it) for a bug
            log.exception("video %s: its end could not be written", job_id)
            self._forget(job_id, held)
        self.wake()

    def _settle_later(self, job_id: str, held: Held, write: Callable[[], None]) -> None:
        """``_settle`` off the engine's loop thread (a remote store may take seconds)."""
        try:
            self._pool.submit(self._settle, job_id, held, write)
        except RuntimeError:  # the pool is shut down: the server is stopping
            self._settle(job_id, held, write)

    # -- called from the engine's loop thread -------------------------------------------------
    def _on_event(self, job_id: str, event: Any) -> None:
        if event.kind != "step":
            return
        with self._lock:
            held = self._held.get(job_id)
            if held is not None and self.store.shared:
                self._progress[job_id] = (event.step, event.eta_s)
        if held is None:
            return
        if self.store.shared:
            if time.monotonic() - self._progress_written >= PROGRESS_S:
                self._wake.set()  # else the next turn writes it (within PROGRESS_S)
            return
        try:  # never let a failed progress write reach the engine's step loop
            self.store.stepped(job_id, held.token, event.step, event.eta_s)
        except Exception:
            log.exception("video %s: progress not recorded", job_id)

    def _on_done(self, job_id: str, held: Held, future: concurrent.futures.Future[Any]) -> None:
        held.in_engine = False
        self._wake.set()  # a batch slot is free
        with self._lock:
            if self._held.get(job_id) is not held:
                return  # let go meanwhile (cancelled, taken over): nothing to write
        error = future.exception()
        if error is None:
            try:
                self._pool.submit(self._store_result, job_id, held, future.result())
                return
            except RuntimeError:  # the pool is shut down: the server is stopping
                error = EngineStoppedError("the server stops")
        if isinstance(error, (RequestAborted, EngineStoppedError)):
            # The engine stops (drain, shutdown): another replica (or this one, restarted) runs
            # it. Let go first: once written, any claimer (this thread too) may take the job,
            # and a stale Held would pass for our run going on (idle until its lease ran out).
            log.info("video %s: handed back to the queue (this replica stops)", job_id)
            self._forget(job_id, held)
            self._settle_later(job_id, held, partial(self.store.hand_back, job_id, held.token))
            return
        if isinstance(error, DeadlineError):
            code, message = "deadline_exceeded", str(error)
        else:
            log.warning("video %s failed in the engine: %s", job_id, error)
            code, message = "generation_failed", (f"the engine failed to generate this video "
                                                  f"(job {job_id}); see the server log")
        self._settle_later(job_id, held, partial(self.store.fail, job_id, code, message,
                                                 token=held.token))

    # -- encoding threads ------------------------------------------------------------------------
    def _store_result(self, job_id: str, held: Held, result: Any) -> None:
        from ditserve.engine.media.video import mp4_bytes

        token = held.token
        try:
            audio = None if result.audio is None else (result.audio[0], result.audio_rate)
            data = mp4_bytes(result.pixels[0], fps=held.spec.fps, audio=audio)
        except Exception as e:
            log.exception("video %s: encoding failed", job_id)
            self._settle(job_id, held, partial(self.store.fail, job_id, "encoding_failed",
                                               f"the video could not be encoded: {e}",
                                               token=token))
            return
        try:
            path, created = self.store.files.publish(job_id, data)
        except StorageError as e:
            log.warning("video %s: not stored: %s", job_id, e)
            code = "storage_full" if e.no_space else "storage_error"
            self._settle(job_id, held, partial(
                self.store.fail, job_id, code, f"the video was generated but could not be "
                f"stored ({e}); create it again later", token=token))
            return

        def record() -> None:
            if self.store.complete(job_id, path, len(data)) or not created:
                return
            # Not ours to keep unless another claim's record names this very file.
            current = self.store.job(job_id)
            if current is None or current.status is not JobStatus.COMPLETED:
                self.store.files.remove(job_id)

        self._settle(job_id, held, record)
