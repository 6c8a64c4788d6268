"""RedisBackend: jobs shared by every replica of a deployment, and the queue they pull from.

Keys (``P`` = ``ditserve:{<namespace>}``; the braces keep one deployment's keys in one
Redis Cluster slot, so its transactions stay possible there):

- ``P:job:<id>``: the job's JSON record (``jobs.records``);
- ``P:ids``: every id, in a sorted set read lexicographically (ids sort by creation);
- ``P:expiry``: finished jobs by their ``expires_at``;
- ``P:usage``: the jobs and bytes held (admission reads it, every change keeps it exact);
- ``P:queue``: the work queue, a Redis stream read by the consumer group ``workers``;
- ``P:leases``: the longest ``--job-lease`` a replica of the namespace claimed with (a job is
  taken from its replica only after that long without a renewal).

The queue is Redis Streams' reliable delivery: ``XREADGROUP`` hands an entry to one replica
(it stays in the group's pending list under that replica's name), the replica's lease is that
pending entry's idle time - reset by ``XCLAIM`` to itself every third of a lease - and a
replica that stops renewing (killed, cut off) leaves an entry that ``XAUTOCLAIM`` hands to
the next replica with room once it has been idle for a whole lease. Lease time is Redis's
own clock, so replicas' clocks never matter. The job record says which claim is current (its
``token``): a replica whose lease was taken over can no longer move the job, and the first
result written wins (``JobStore.complete``), so a job never completes twice.

Each change of a record is an optimistic transaction (``WATCH`` the key, read, ``MULTI``,
write, ``EXEC``; redis-py retries it when another replica changed the key meanwhile). A
connection error or timeout is ``StoreUnavailable``: socket timeouts are short so a dead
Redis costs a request 2 s, never a hang.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import redis
from redis.client import Pipeline

from ditserve.engine.server.jobs.backend import Change, Usage
from ditserve.engine.server.jobs.errors import StoreUnavailable
from ditserve.engine.server.jobs.model import VideoJob
from ditserve.engine.server.jobs.records import decode_job, encode_job

log = logging.getLogger(__name__)

GROUP = "workers"
TIMEOUT_S = 2.0
GONE_CONSUMER_S = 3600.0  # a consumer that read nothing this long belongs to a replica gone
UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
               redis.exceptions.BusyLoadingError)


class RedisBackend:
    """See the module docstring."""

    shared = True

    def __init__(self, url: str, *, namespace: str) -> None:
        self.url = url
        # Any: redis-py types each reply as the union of every decoding mode; with
        # decode_responses=True they are str (and lists, dicts of str).
        self._r: Any = redis.Redis.from_url(url, decode_responses=True, socket_timeout=TIMEOUT_S,
                                       socket_connect_timeout=TIMEOUT_S,
                                       health_check_interval=10)
        prefix = f"ditserve:{{{namespace}}}"
        self._ids, self._expiry = f"{prefix}:ids", f"{prefix}:expiry"
        self._usage, self._queue = f"{prefix}:usage", f"{prefix}:queue"
        self._job_prefix = f"{prefix}:job:"
        self._leases = f"{prefix}:leases"  # the longest --job-lease (ms) of its replicas
        self._group_ready = False

    def check_database(self) -> None:
        """At start: reach the server and its database. Raises StoreUnavailable when Redis
        cannot be reached (it may come back), ValueError when it refuses the URL's database
        (``DB index is out of range``): that is the configuration, not an outage."""
        try:
            with self._reach():
                self._r.ping()
        except redis.exceptions.ResponseError as e:
            raise ValueError(f"Redis refused the job store URL: {e}") from e

    def _key(self, job_id: str) -> str:
        return self._job_prefix + job_id

    @contextlib.contextmanager
    def _reach(self) -> Iterator[None]:
        try:
            yield
        except UNREACHABLE as e:
            self._group_ready = False  # a restarted Redis may have lost the group
            raise StoreUnavailable(f"the job store (Redis) cannot be reached: {e}") from e
        except redis.exceptions.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._group_ready = False  # recreated by the next call
            raise StoreUnavailable(f"the job queue is gone (a Redis restarted without its "
                                   f"data?): {e}") from e

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self._r.xgroup_create(self._queue, GROUP, id="0", mkstream=True)
        except redis.exceptions.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True
        self._forget_gone_consumers()

    def _forget_gone_consumers(self) -> None:
        """Each replica process reads as a consumer of its own name, which Redis keeps in the
        group for good: drop those that hold no entry and have not read for an hour (every
        live replica reads every ``POLL_S``; one dropped by mistake is made again by its next
        read), so rollouts and restarts do not grow the group without bound."""
        for consumer in self._r.xinfo_consumers(self._queue, GROUP):
            if consumer["pending"] == 0 and consumer["idle"] >= GONE_CONSUMER_S * 1000:
                self._r.xgroup_delconsumer(self._queue, GROUP, consumer["name"])

    # -- the JobBackend contract ---------------------------------------------------------------
    def add(self, job: VideoJob, admit: Callable[[Usage], None]) -> None:
        def insert(pipe: Pipeline) -> None:
            usage = pipe.hgetall(self._usage)
            soonest = pipe.zrange(self._expiry, 0, 0, withscores=True)
            admit(Usage(int(usage.get("jobs", 0)), int(usage.get("bytes", 0)),
                        soonest[0][1] if soonest else None))
            pipe.multi()
            pipe.set(self._key(job.id), encode_job(job))
            pipe.zadd(self._ids, {job.id: 0})
            pipe.hincrby(self._usage, "jobs", 1)
            pipe.hincrby(self._usage, "bytes", job.held_bytes)
            pipe.xadd(self._queue, {"id": job.id})

        with self._reach():
            self._ensure_group()
            self._r.transaction(insert, self._usage)

    def get(self, job_id: str) -> VideoJob | None:
        with self._reach():
            raw = self._r.get(self._key(job_id))
        return _decoded(job_id, raw) if raw is not None else None

    def page(self, *, limit: int, after: str | None, descending: bool
             ) -> tuple[list[VideoJob], bool]:
        with self._reach():
            if descending:
                ids = self._r.zrevrangebylex(self._ids, f"({after}" if after else "+", "-",
                                             start=0, num=limit + 1)
            else:
                ids = self._r.zrangebylex(self._ids, f"({after}" if after else "-", "+",
                                          start=0, num=limit + 1)
            jobs = self._load(ids[:limit])
        return jobs, len(ids) > limit

    def jobs(self) -> list[VideoJob]:
        with self._reach():
            return self._load(self._r.zrange(self._ids, 0, -1))

    def _load(self, ids: list[str]) -> list[VideoJob]:
        if not ids:
            return []
        raws = self._r.mget([self._key(i) for i in ids])
        jobs = []
        for job_id, raw in zip(ids, raws, strict=True):
            if raw is None:  # removed meanwhile
                continue
            try:
                jobs.append(decode_job(raw))
            except (ValueError, KeyError, TypeError) as e:
                # One record this version cannot read (a newer replica's, mid-rollout) must
                # not take the list, the metrics and every other job with it.
                _warn_unreadable(job_id, e)
        return jobs

    def update(self, job_id: str, change: Change) -> VideoJob | None:
        key = self._key(job_id)

        def modify(pipe: Pipeline) -> VideoJob | None:
            raw = pipe.get(key)
            if raw is None:
                return None
            job = _decoded(job_id, raw)
            before = decode_job(raw)
            if change(job) is False:
                return None
            pipe.multi()
            self._write(pipe, before, job)
            return job

        with self._reach():
            return self._r.transaction(modify, key, value_from_callable=True)

    def _write(self, pipe: Pipeline, before: VideoJob, job: VideoJob) -> None:
        """Queue, in ``pipe``'s MULTI, the writes of ``before`` becoming ``job``."""
        if job.status.is_finished and job.queue_entry is not None:
            self._done_with(pipe, job.queue_entry)
            job.queue_entry = None
        elif not job.status.is_finished and job.owner is None and before.owner is not None:
            # Handed back (its replica stops, or the engine could not take it): queue again.
            if job.queue_entry is not None:
                self._done_with(pipe, job.queue_entry)
                job.queue_entry = None
            pipe.xadd(self._queue, {"id": job.id})
        pipe.set(self._key(job.id), encode_job(job))
        if job.held_bytes != before.held_bytes:
            pipe.hincrby(self._usage, "bytes", job.held_bytes - before.held_bytes)
        if job.expires_at is not None:
            pipe.zadd(self._expiry, {job.id: job.expires_at})

    def _done_with(self, pipe: Any, entry: str) -> None:
        pipe.xack(self._queue, GROUP, entry)
        pipe.xdel(self._queue, entry)

    def remove(self, job_id: str) -> VideoJob | None:
        key = self._key(job_id)

        def drop(pipe: Pipeline) -> VideoJob | None:
            raw = pipe.get(key)
            if raw is None:
                return None
            job = _decoded(job_id, raw)
            pipe.multi()
            pipe.delete(key)
            pipe.zrem(self._ids, job_id)
            pipe.zrem(self._expiry, job_id)
            pipe.hincrby(self._usage, "jobs", -1)
            pipe.hincrby(self._usage, "bytes", -job.held_bytes)
            if job.queue_entry is not None:
                self._done_with(pipe, job.queue_entry)
            return job

        with self._reach():
            return self._r.transaction(drop, key, value_from_callable=True)

    def expired(self, now: float) -> list[str]:
        with self._reach():
            return list(self._r.zrangebyscore(self._expiry, "-inf", now))

    def claim(self, owner: str, lease_s: float, take: Change) -> VideoJob | None:
        lease_ms = max(1, int(lease_s * 1000))
        with self._reach():
            self._ensure_group()
            while True:  # entries of jobs deleted or finished meanwhile are dropped on the way
                entry = self._next_entry(owner, lease_ms)
                if entry is None:
                    return None
                entry_id, job_id = entry

                def take_entry(job: VideoJob, entry_id: str = entry_id) -> bool:
                    if job.status.is_finished or take(job) is False:
                        return False
                    job.queue_entry = entry_id
                    return True

                job = self.update(job_id, take_entry) if job_id else None
                if job is not None:
                    return job
                current = self.get(job_id) if job_id else None
                if current is None or current.status.is_finished:
                    with self._r.pipeline() as pipe:
                        self._done_with(pipe, entry_id)
                        pipe.execute()
                else:
                    return None  # ``take`` declined: the entry stays pending, its lease runs

    def _next_entry(self, owner: str, lease_ms: int) -> tuple[str, str] | None:
        """(entry id, job id): first an entry whose lease expired, else a new one. Expired
        by the longest lease any replica of the namespace holds its jobs for: one replica's
        shorter ``--job-lease`` must not take jobs another renews only every third of its
        own (it would restart them from step 0 on a healthy replica)."""
        with self._r.pipeline(transaction=False) as pipe:  # one round trip per look
            pipe.zadd(self._leases, {"longest": lease_ms}, gt=True)
            pipe.zscore(self._leases, "longest")
            _, longest = pipe.execute()
        lease_ms = max(lease_ms, int(longest or 0))
        _, taken, _ = self._r.xautoclaim(self._queue, GROUP, owner, lease_ms, "0-0", count=1)
        if not taken:
            read = self._r.xreadgroup(GROUP, owner, {self._queue: ">"}, count=1)
            taken = read[0][1] if read else []
        if not taken:
            return None
        entry_id, fields = taken[0]
        return entry_id, (fields or {}).get("id", "")

    def renew(self, job_id: str, token: str, lease_s: float) -> VideoJob | None:
        with self._reach():
            job = self.get(job_id)
            if job is not None and job.token == token and job.owner is not None \
                    and not job.status.is_finished and job.queue_entry is not None:
                # min idle 0 to itself: resets the entry's idle time, the lease's clock.
                self._r.xclaim(self._queue, GROUP, job.owner, 0, [job.queue_entry],
                               justid=True)
            return job

    def close(self) -> None:
        self._r.close()


_warned: set[str] = set()


def _warn_unreadable(job_id: str, error: Exception) -> None:
    if job_id not in _warned:  # once per job: lists and metric scrapes read it again
        _warned.add(job_id)
        log.warning("video job %s: its record cannot be read here and is left out (%s)",
                    job_id, error)


def _decoded(job_id: str, raw: str | bytes) -> VideoJob:
    """The job of ``raw``; a record this version cannot read is the store's to answer for
    (503, retried: during a rollout another replica reads it), never a 500."""
    try:
        return decode_job(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise StoreUnavailable(f"video job {job_id} was written by a ditserve this replica "
                               f"cannot read ({e}); another replica may answer") from e
