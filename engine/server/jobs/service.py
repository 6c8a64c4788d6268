"""VideoJobs: a video job's way through the engine, from admission to a stored MP4.

``create`` admits the job to the store (its bounds), then to the engine exactly as an image
request is admitted (``engine.add_request``: the same batch slots, queue bound and 429s;
the job id is the engine's request id), and answers at once. The engine's progress events
move the job to ``in_progress`` and its progress up; when the engine's future resolves, an
encoding thread writes the MP4 (``engine.video.mp4_bytes``) and publishes it atomically
(``VideoFiles.publish``): only then is the job ``completed``. Every other end is a failed job
with a clear error - the engine failed it (``generation_failed``), the server stopped first
(``engine_stopped``), the encoder failed (``encoding_failed``), the disk is full
(``storage_full``) or another write error (``storage_error``) - and frees its reservation.
``delete`` cancels an unfinished job (aborting the engine's request frees its batch slot at
the next step boundary) and forgets it.

Built by ServerState; called by routes/videos.py. Encoding runs in this class's own threads,
never in the engine's step loop (it would leave the GPU idle) nor on the event loop.
"""

from __future__ import annotations

import concurrent.futures
import logging
from functools import partial
from typing import Any

from ditserve.engine.client import EngineClient
from ditserve.engine.errors import DeadlineError, EngineStoppedError, RequestAborted
from ditserve.engine.server.jobs.files import StorageError
from ditserve.engine.server.jobs.model import VideoSpec
from ditserve.engine.server.jobs.store import JobStore

log = logging.getLogger(__name__)

ENCODE_THREADS = 2  # libx264 threads internally; two jobs may encode while others denoise


class VideoJobs:
    """See the module docstring."""

    def __init__(self, engine: EngineClient, store: JobStore, *, encode_threads: int = ENCODE_THREADS
                 ) -> None:
        self.engine = engine
        self.store = store
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=encode_threads, thread_name_prefix="ditserve-video-encode")

    def create(self, spec: VideoSpec, *, request_id: str) -> dict[str, Any]:
        """Admit a job; raises StoreFull, then whatever ``engine.add_request`` raises
        (QueueFullError, EngineStoppedError, InvalidRequestError). Returns its object as
        admitted (queued, as OpenAI answers; the engine may have begun it already)."""
        admitted = self.store.add(spec, request_id)
        job_id = admitted["id"]
        try:
            handle = self.engine.add_request(spec.params, request_id=job_id,
                                             on_event=partial(self._on_event, job_id))
        except BaseException:
            self.store.remove_unstarted(job_id)
            raise
        if not self.store.started(job_id, engine_id=handle.request_id, seed=handle.seed):
            self.engine.abort(handle.request_id, "cancelled")  # a DELETE came first
        handle.future.add_done_callback(partial(self._on_done, job_id, spec))
        admitted["ditserve"]["seed"] = handle.seed
        return admitted

    def delete(self, job_id: str) -> bool:
        """Delete a job: an unfinished one is cancelled first (its batch slot frees at the
        next step), a finished one goes with its file. False: no such job."""
        existed, engine_id = self.store.delete(job_id)
        if engine_id is not None:
            self.engine.abort(engine_id, "cancelled")
        return existed

    def busy(self) -> bool:
        """Whether some job has not finished (the drain waits for it)."""
        return self.store.unfinished() > 0

    def close(self) -> None:
        """After the engine stopped: finish the encodes under way, release the directory."""
        self._pool.shutdown(wait=True)
        self.store.files.close()

    # -- called from the engine's loop thread -------------------------------------------------
    def _on_event(self, job_id: str, event: Any) -> None:
        if event.kind == "step":
            self.store.stepped(job_id, event.step, event.eta_s)

    def _on_done(self, job_id: str, spec: VideoSpec,
                 future: concurrent.futures.Future[Any]) -> None:
        error = future.exception()
        if error is None:
            try:
                self._pool.submit(self._store_result, job_id, spec, future.result())
            except RuntimeError:  # the pool is shut down: the server is stopping
                self.store.fail(job_id, "engine_stopped", _STOPPED)
            return
        if isinstance(error, (RequestAborted, EngineStoppedError)):
            # A cancelled job is already finished (this does nothing); else the server stops.
            self.store.fail(job_id, "engine_stopped", _STOPPED)
            return
        if isinstance(error, DeadlineError):
            self.store.fail(job_id, "deadline_exceeded", str(error))
            return
        log.warning("video %s failed in the engine: %s", job_id, error)
        self.store.fail(job_id, "generation_failed", f"the engine failed to generate this "
                        f"video (job {job_id}); see the server log")

    # -- encoding threads ------------------------------------------------------------------------
    def _store_result(self, job_id: str, spec: VideoSpec, result: Any) -> None:
        from ditserve.engine.video import mp4_bytes

        try:
            audio = None if result.audio is None else (result.audio[0], result.audio_rate)
            data = mp4_bytes(result.pixels[0], fps=spec.fps, audio=audio)
        except Exception as e:
            log.exception("video %s: encoding failed", job_id)
            self.store.fail(job_id, "encoding_failed", f"the video could not be encoded: {e}")
            return
        try:
            path = self.store.files.publish(job_id, data)
        except StorageError as e:
            log.warning("video %s: not stored: %s", job_id, e)
            code = "storage_full" if e.no_space else "storage_error"
            self.store.fail(job_id, code, f"the video was generated but could not be stored "
                            f"({e}); create it again later")
            return
        if not self.store.complete(job_id, path, len(data)):
            self.store.files.remove(path)  # cancelled or deleted while it was encoded


_STOPPED = ("the server stopped before the video was finished; create it again (on another "
            "replica)")
