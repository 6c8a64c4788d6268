"""A video job: its status machine, its id, and its OpenAI ``video`` object.

``VideoJob`` is plain data, kept by a job backend (``jobs.backend``: SQLite or Redis) as a
JSON record (``jobs.records``); only ``JobStore`` changes it (one atomic read-modify-write per
change, whichever replica makes it), so a job's status moves in one place. ``JobStatus``
sorts its final states last, as ``RequestStatus`` does.
``video_object`` renders a job as OpenAI's Videos API object (id, ``object: "video"``, status,
progress, created_at, completed_at, expires_at, error, model, prompt, seconds, size; a
cancelled job reads ``failed`` with error code ``cancelled``), plus
ditserve's own ``ditserve`` object (frames, fps, steps, seed, timings, bytes, the claims so
far and the replica running it). ``StoreLimits`` (the store's bounds), ``Content`` (where a
completed job's MP4 is) and ``JobObserver`` (who hears finished jobs) are the store's plain
types.

Ids are ``video_`` + 32 hex digits whose first 16 are a strictly increasing number (the
creation time in nanoseconds, bumped on ties): sorting ids sorts jobs by creation, so the
list's ``after`` cursor stays meaningful after the job it names was deleted or expired.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from ditserve.engine.errors import DeadlineError
from ditserve.engine.request import SamplingParams
from ditserve.engine.server.config import (
    DEFAULT_VIDEO_MAX_BYTES,
    DEFAULT_VIDEO_MAX_JOBS,
    DEFAULT_VIDEO_TTL_S,
)

JOB_ID_PATTERN = re.compile(r"video_[0-9a-f]{32}")
OBJECT = "video"
DELETED_OBJECT = "video.deleted"


class JobStatus(enum.IntEnum):
    """queued -> in_progress -> completed | failed | cancelled (finished states sort last)."""

    QUEUED = 0
    IN_PROGRESS = 1
    COMPLETED = 2
    FAILED = 3
    CANCELLED = 4

    @property
    def is_finished(self) -> bool:
        return self >= JobStatus.COMPLETED

    @property
    def label(self) -> str:
        """The metrics' spelling (``ditserve:video_jobs{status=...}``)."""
        return self.name.lower()

    @property
    def api_status(self) -> str:
        """The API's spelling, one of OpenAI's ``Video.status`` values: a cancelled job is
        ``failed`` with error code ``cancelled`` (the SDK's Video has no "cancelled")."""
        return JobStatus.FAILED.label if self is JobStatus.CANCELLED else self.label


# The labels of the states a job ends in (the metrics' spelling).
FINISHED_LABELS = tuple(s.label for s in JobStatus if s.is_finished)
# The statuses the API reports (OpenAI's), and those a job ends in.
API_STATUSES = tuple(dict.fromkeys(s.api_status for s in JobStatus))
API_FINISHED = tuple(dict.fromkeys(s.api_status for s in JobStatus if s.is_finished))


_id_lock = threading.Lock()
_last_stamp = 0


def new_job_id() -> str:
    """A fresh id, greater than every id made before it in this process."""
    global _last_stamp
    with _id_lock:
        _last_stamp = max(_last_stamp + 1, time.time_ns())
        stamp = _last_stamp
    return f"video_{stamp:016x}{secrets.token_hex(8)}"


@dataclass(frozen=True)
class VideoSpec:
    """What a client asked for, validated: the engine's params and the MP4's frame rate.

    seconds: the clip's duration as OpenAI reports it (frames / fps, e.g. "5.0625" for 81
        frames at 16 fps).
    """

    params: SamplingParams
    fps: int
    model: str

    @property
    def size(self) -> str:
        return f"{self.params.width}x{self.params.height}"

    @property
    def duration_s(self) -> float:
        return self.params.num_frames / self.fps

    @property
    def seconds(self) -> str:
        return f"{self.duration_s:g}"

    def without_media(self) -> VideoSpec:
        """This spec without its input media (images, references): what a finished job keeps,
        since an input_reference may be a large photo and nothing needs it any more."""
        p = self.params
        if not (p.images or p.references):
            return self
        return dataclasses.replace(self, params=dataclasses.replace(p, images=(), references=()))

    @property
    def raw_bytes(self) -> int:
        """RGB bytes of the frames: the store reserves this much until the MP4 exists (H.264
        at the writer's quality is far smaller, so the reservation bounds the file)."""
        p = self.params
        return p.num_frames * p.height * p.width * 3 + 64 * 1024  # + container headroom


@dataclass
class VideoJob:
    """One job. Changed only by ``JobStore``; read a snapshot with ``video_object``.

    The lease fields say which replica runs it: ``owner`` (a replica's worker id) and
    ``token`` (one claim: a re-claimed job gets a new one, so a replica that lost its lease
    can no longer move the job), ``attempts`` (claims so far: a job whose replicas died
    ``MAX_ATTEMPTS`` times fails with ``job_interrupted``), ``queue_entry`` (the backend's own
    handle on the job's place in the work queue, e.g. a Redis stream entry id).
    """

    id: str
    spec: VideoSpec
    request_id: str
    created_at: float
    status: JobStatus = JobStatus.QUEUED
    steps_done: int = 0
    seed: int | None = None
    started_at: float | None = None
    completed_at: float | None = None
    expires_at: float | None = None
    error: dict[str, str] | None = None
    path: str | None = None  # where the MP4 was published (a file, an s3:// URL)
    size_bytes: int = 0  # the MP4's size, once completed
    reserved_bytes: int = 0  # counted against the store's byte bound
    eta_s: float | None = None  # the scheduler's estimate of the seconds left, per step
    owner: str | None = None
    token: str | None = None
    attempts: int = 0
    queue_entry: str | None = None

    @property
    def held_bytes(self) -> int:
        """What the job counts against the store's byte bound."""
        return self.size_bytes + self.reserved_bytes

    def params_at(self, now: float) -> SamplingParams:
        """The job's request as an engine takes it at ``now``: its ``deadline_s`` counts from
        the job's creation (a client's clock), not from this claim, so the time it waited in
        the queue (or ran on a replica that died) is spent; DeadlineError once it is past."""
        params = self.spec.params
        if params.deadline_s is None:
            return params
        waited = max(0.0, now - self.created_at)
        if waited >= params.deadline_s:
            raise DeadlineError(f"the job waited {waited:.1f} s in the queue, past its "
                                f"deadline_s {params.deadline_s:g}")
        return dataclasses.replace(params, deadline_s=params.deadline_s - waited)

    @property
    def progress(self) -> int:
        """0-100: the share of denoise steps done, 100 only once the MP4 is stored."""
        if self.status is JobStatus.COMPLETED:
            return 100
        total = self.spec.params.num_inference_steps
        return min(99, 100 * self.steps_done // total) if total else 0


@dataclass(frozen=True)
class StoreLimits:
    """max_jobs: jobs held at once, any state. max_bytes: stored MP4 bytes plus unfinished
    jobs' reservations. ttl_s: how long a finished job (and its file) is kept."""

    max_jobs: int = DEFAULT_VIDEO_MAX_JOBS
    max_bytes: int = DEFAULT_VIDEO_MAX_BYTES
    ttl_s: float = DEFAULT_VIDEO_TTL_S


class JobObserver(Protocol):
    def on_job_finished(self, status: str, video_seconds: float) -> None: ...


@dataclass(frozen=True)
class Content:
    """A completed job's MP4: its size and when it was made (read it from the result
    store by the job's id)."""

    size: int
    completed_at: float


def video_object(job: VideoJob) -> dict[str, Any]:
    """The OpenAI ``video`` object of ``job`` (call under the store's lock, or on a copy)."""
    spec, p = job.spec, job.spec.params
    latency = (job.completed_at - job.created_at) if job.completed_at is not None else None
    queued = (job.started_at - job.created_at) if job.started_at is not None else None
    return {
        "id": job.id,
        "object": OBJECT,
        "model": spec.model,
        "status": job.status.api_status,
        "progress": job.progress,
        "created_at": int(job.created_at),
        "completed_at": int(job.completed_at) if job.completed_at is not None else None,
        "expires_at": int(job.expires_at) if job.expires_at is not None else None,
        "error": dict(job.error) if job.error else None,
        "prompt": p.prompt,
        "remixed_from_video_id": None,
        "seconds": spec.seconds,
        "size": spec.size,
        "ditserve": {
            "request_id": job.request_id,
            "num_frames": p.num_frames,
            "fps": spec.fps,
            "num_inference_steps": p.num_inference_steps,
            "steps_done": job.steps_done,
            "guidance_scale": p.guidance_scale,
            "negative_prompt": p.negative_prompt,
            "seed": job.seed,
            "queue_seconds": round(queued, 6) if queued is not None else None,
            "latency_seconds": round(latency, 6) if latency is not None else None,
            "bytes": job.size_bytes if job.status is JobStatus.COMPLETED else None,
            "priority": p.priority,
            "deadline_s": p.deadline_s,
            "estimated_seconds_left": (round(job.eta_s, 3) if job.eta_s is not None
                                       and not job.status.is_finished else None),
            "attempts": job.attempts,
            "replica": job.owner,
        },
    }


def deleted_object(job_id: str) -> dict[str, Any]:
    """OpenAI's answer to a delete."""
    return {"id": job_id, "object": DELETED_OBJECT, "deleted": True}
