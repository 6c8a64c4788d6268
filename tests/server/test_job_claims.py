"""Claims and leases of the job store on both real backends (SQLite and a real
redis-server): the oldest job goes first and to one replica only, a hand-back queues it
again, a dead replica's job goes to the next claimer once its lease expired (with a new
token: the old claim can no longer move it), the first result wins and a job never
completes twice, a job whose replicas keep dying fails with a reason, a restarted SQLite
server keeps its finished jobs and re-runs the interrupted one, the records round-trip every
request field, and an unreachable Redis is ``StoreUnavailable``."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest
from server.redis_support import RedisServer

from ditserve.engine.condition_image import ConditionImage
from ditserve.engine.config.step_cache import StepCacheSpec
from ditserve.engine.reference_media import ReferenceAudio, ReferenceVideo
from ditserve.engine.request import LoraRef, SamplingParams
from ditserve.engine.server.jobs.errors import StoreUnavailable
from ditserve.engine.server.jobs.files import VideoFiles
from ditserve.engine.server.jobs.model import JobStatus, VideoJob, VideoSpec
from ditserve.engine.server.jobs.records import decode_job, encode_job
from ditserve.engine.server.jobs.sqlite_backend import SqliteBackend
from ditserve.engine.server.jobs.store import MAX_ATTEMPTS, JobStore, StoreLimits

LEASE_S = 0.3  # Redis times leases itself: the tests that outlive one sleep that long
_namespaces = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def spec(seed: int = 1) -> VideoSpec:
    params = SamplingParams(prompt="p", height=16, width=16, num_frames=5, seed=seed)
    return VideoSpec(params=params, fps=8, model="m")


class Backends:
    """Opens stores on one backend: two "replicas" share its jobs (Redis), or a "restart"
    reopens the same file (SQLite)."""

    def __init__(self, kind: str, tmp: Path, request: pytest.FixtureRequest) -> None:
        self.kind, self.tmp, self.request = kind, tmp, request
        self.clock = Clock()
        self.namespace = f"claims-{next(_namespaces)}-{tmp.name}"
        self.opened: list[JobStore] = []

    def open(self) -> JobStore:
        root = self.tmp / "videos"
        if self.kind == "sqlite":
            files = VideoFiles(root)
            backend = SqliteBackend(root / "jobs.sqlite3", clock=self.clock)
        else:
            from ditserve.engine.server.jobs.redis_backend import RedisBackend

            files = VideoFiles(root, shared=True)
            backend = RedisBackend(self.request.getfixturevalue("redis_server").url,
                                   namespace=self.namespace)
        store = JobStore(StoreLimits(), files, backend, clock=self.clock)  # type: ignore[arg-type]
        self.opened.append(store)
        return store

    def expire_leases(self) -> None:
        if self.kind == "sqlite":
            self.clock.now += LEASE_S + 1  # SQLite leases run on the store's clock
        else:
            time.sleep(LEASE_S + 0.2)  # Redis's own clock: the entry's idle time


@pytest.fixture(params=["sqlite", "redis"])
def backends(request, tmp_path: Path):
    made = Backends(request.param, tmp_path, request)
    yield made
    for store in made.opened:
        store.close()


def test_the_oldest_job_goes_first_and_to_one_claimer(backends) -> None:
    store = backends.open()
    first, second = (store.add(spec(i), "r")["id"] for i in range(2))
    a = store.claim("replica-a", 30)
    b = store.claim("replica-b", 30)
    assert (a.id, a.owner, a.attempts) == (first, "replica-a", 1)
    assert (b.id, b.owner) == (second, "replica-b") and a.token != b.token
    assert store.claim("replica-c", 30) is None  # nothing left
    assert store.hand_back(a.id, a.token)  # its replica stops: back in the queue
    again = store.claim("replica-c", 30)
    assert (again.id, again.attempts) == (first, 1)  # a hand-back is not an attempt
    assert store.get(first)["status"] == "queued"


def test_a_dead_claimers_job_goes_to_the_next_after_its_lease(backends) -> None:
    store = backends.open()
    job_id = store.add(spec(), "r")["id"]
    dead = store.claim("replica-dead", LEASE_S)
    assert store.started(job_id, dead.token, seed=1)
    assert store.stepped(job_id, dead.token, 2)
    assert store.claim("replica-b", LEASE_S) is None  # the lease still holds
    backends.expire_leases()
    taken = store.claim("replica-b", LEASE_S)
    assert (taken.id, taken.owner, taken.attempts) == (job_id, "replica-b", 2)
    assert taken.token != dead.token and taken.steps_done == 0  # it runs again from step 0
    # The old claim can no longer move the job, nor extend a lease...
    assert not store.stepped(job_id, dead.token, 3)
    assert not store.fail(job_id, "generation_failed", "late", token=dead.token)
    assert store.renew(job_id, dead.token, LEASE_S).token == taken.token
    # ...but a result is a result: the first one written wins, the second is refused.
    path, created = store.files.publish(job_id, b"the old claim's video")
    assert created and store.complete(job_id, path, 21)
    assert store.files.publish(job_id, b"the new claim's video") == (path, False)
    assert not store.complete(job_id, path, 21)
    done = store.get(job_id)
    assert (done["status"], done["progress"]) == ("completed", 100)
    # Every step ran, though the steps the store heard of stopped at 0 (the new claim's)
    steps = done["ditserve"]["num_inference_steps"]
    assert done["ditserve"]["steps_done"] == steps > 0
    assert store.claim("replica-c", LEASE_S) is None  # a finished job is never claimed


def test_renewal_keeps_a_lease(backends) -> None:
    store = backends.open()
    job_id = store.add(spec(), "r")["id"]
    mine = store.claim("replica-a", LEASE_S)
    for _ in range(3):
        if backends.kind == "sqlite":
            backends.clock.now += LEASE_S * 0.6
        else:
            time.sleep(LEASE_S * 0.6)
        assert store.renew(job_id, mine.token, LEASE_S).token == mine.token
        assert store.claim("replica-b", LEASE_S) is None


def test_a_job_whose_replicas_keep_dying_fails_with_a_reason(backends) -> None:
    store = backends.open()
    job_id = store.add(spec(), "r")["id"]
    for attempt in range(1, MAX_ATTEMPTS + 1):
        claimed = store.claim(f"replica-{attempt}", LEASE_S)
        assert (claimed.id, claimed.attempts) == (job_id, attempt)
        backends.expire_leases()
    assert store.claim("replica-last", LEASE_S) is None
    failed = store.get(job_id)
    assert (failed["status"], failed["error"]["code"]) == ("failed", "job_interrupted")
    assert f"stopped {MAX_ATTEMPTS} times" in failed["error"]["message"]
    assert failed["ditserve"]["attempts"] == MAX_ATTEMPTS  # the claims that ran, no more


def test_cancel_reaches_the_replica_running_the_job(backends) -> None:
    store = backends.open()
    job_id = store.add(spec(), "r")["id"]
    mine = store.claim("replica-a", 30)
    assert store.delete(job_id) == (True, "replica-a")
    assert store.renew(job_id, mine.token, 30) is None  # the replica lets go at renewal
    assert store.claim("replica-b", 30) is None  # and no one else runs it


def test_two_replicas_share_jobs_through_redis(tmp_path: Path, request) -> None:
    backends = Backends("redis", tmp_path, request)  # (one server per SQLite file)
    a, b = backends.open(), backends.open()
    job_id = a.add(spec(), "r")["id"]
    assert b.get(job_id)["id"] == job_id
    claimed = b.claim("replica-b", 30)
    b.stepped(job_id, claimed.token, 1)
    assert a.get(job_id)["status"] == "in_progress"
    assert [j["id"] for j in a.page(limit=5, after=None, order="desc")[0]] == [job_id]
    # Another deployment in the same Redis (another namespace) never sees these jobs.
    backends.namespace += "-other"
    other = backends.open()
    other.add(spec(), "r")
    assert other.get(job_id) is None and a.claim("replica-a", 30) is None
    assert len(other.page(limit=5, after=None, order="desc")[0]) == 1
    for store in backends.opened:
        store.close()


def test_a_sqlite_restart_keeps_jobs_and_reruns_the_interrupted_one(tmp_path: Path,
                                                                     request) -> None:
    first = Backends("sqlite", tmp_path, request)
    store = first.open()
    done_id = store.add(spec(1), "r")["id"]
    assert store.claim("before", 30).id == done_id
    path, _ = store.files.publish(done_id, b"finished before the restart")
    assert store.complete(done_id, path, 27)
    running_id = store.add(spec(2), "r")["id"]
    running = store.claim("before", 30)
    store.stepped(running_id, running.token, 3)
    queued_id = store.add(spec(3), "r")["id"]
    store.backend.close()  # the process dies (no hand-back); its flocks go with it
    store.files.close()
    after = first.open()  # the same clock: the dead process's lease has not run out
    size = after.content(done_id)[1].size
    reader = after.files.read(done_id, 0, size)
    assert reader.read(1 << 20) == b"finished before the restart"
    reader.close()
    rerun = after.claim("after", 30)
    assert (rerun.id, rerun.attempts, rerun.status) == (running_id, 2, JobStatus.QUEUED)
    assert after.claim("after", 30).id == queued_id
    after.close()


def test_records_round_trip_every_request_field() -> None:
    params = SamplingParams(
        prompt="a fox", negative_prompt="blur", height=32, width=48, num_inference_steps=7,
        guidance_scale=4.5, true_cfg_scale=2.0, seed=9, num_frames=9, partial_images=1,
        images=(ConditionImage(2, 1, bytes(range(6))),), max_sequence_length=64,
        loras=(LoraRef("ink", "/adapters/ink.safetensors", 0.7, 8, 2),),
        step_cache=StepCacheSpec("teacache", threshold=0.2), priority=-1, deadline_s=30.0,
        references=(ConditionImage(1, 2, bytes(range(6))),
                    ReferenceAudio(8000, 2, bytes(range(16))),
                    # A video reference is stored as the file sent (compressed already).
                    ReferenceVideo(b"\0\0\0\x18ftypmp42 frames", 48, 32, 72, 29.97, 8000, 1)))
    job = VideoJob("video_" + "a" * 32, VideoSpec(params, fps=12, model="wan"), "req",
                   created_at=5.0, status=JobStatus.IN_PROGRESS, steps_done=3, owner="r1",
                   token="t", attempts=2, queue_entry="1-0", path="/v/x.mp4")
    assert decode_job(encode_job(job)) == job


def test_a_large_reference_is_packed_once_and_leaves_with_the_finished_job(backends,
                                                                           monkeypatch) -> None:
    from ditserve.engine.server.jobs import records

    # A 3000x2000 photo's pixels (one per backend: the packing is remembered per process).
    rgb = bytes(range(250)) * (3000 * 2000 * 3 // 250 - 1) + bytes(range(250))[::-1]
    rgb = rgb[:-1] + backends.kind[:1].encode()
    params = SamplingParams(prompt="p", height=16, width=16, num_frames=5, seed=1,
                            images=(ConditionImage(3000, 2000, rgb),))
    packed = []
    real = records.zlib.compress
    monkeypatch.setattr(records.zlib, "compress", lambda data, level: (
        packed.append(len(data)), real(data, level))[1])
    store = backends.open()
    job_id = store.add(VideoSpec(params=params, fps=8, model="m"), "r")["id"]
    job = store.claim("replica-a", 30)
    assert job.spec.params.images[0].rgb == rgb  # the worker gets the pixels as sent
    for step in range(1, 4):
        assert store.stepped(job_id, job.token, step)
    assert packed == [len(rgb)]  # every change after the first reused the packed text
    assert store.fail(job_id, "engine_error", "boom", token=job.token)
    finished = store.backend.get(job_id)
    assert finished.spec.params.images == () and finished.status is JobStatus.FAILED
    assert store.get(job_id)["status"] == "failed"  # the job itself is all still there


def test_an_unreachable_redis_is_store_unavailable(tmp_path: Path) -> None:
    from ditserve.engine.server.jobs.redis_backend import RedisBackend

    redis = RedisServer(tmp_path / "redis").start()
    files = VideoFiles(tmp_path / "videos", shared=True)
    store = JobStore(StoreLimits(), files, RedisBackend(redis.url, namespace="down"))
    try:
        job_id = store.add(spec(), "r")["id"]
        redis.pause()  # hung: every call times out
        with pytest.raises(StoreUnavailable, match="cannot be reached"):
            store.add(spec(), "r")
        with pytest.raises(StoreUnavailable):
            store.get(job_id)
        redis.resume()
        assert store.get(job_id)["status"] == "queued"  # nothing was lost
        redis.stop()
        with pytest.raises(StoreUnavailable):
            store.claim("replica-a", 30)
    finally:
        redis.stop()
        store.close()


def test_a_redis_database_the_server_lacks_is_a_config_error(tmp_path: Path) -> None:
    from ditserve.engine.errors import ConfigError
    from ditserve.engine.server.state import open_backend

    redis = RedisServer(tmp_path / "redis").start()
    try:
        with pytest.raises(ConfigError, match="DB index is out of range"):
            open_backend(redis.url.rsplit("/", 1)[0] + "/99", tmp_path, namespace="n",
                         clock=time.time)
        open_backend(redis.url, tmp_path, namespace="n", clock=time.time).close()
    finally:
        redis.stop()


def test_a_sqlite_file_has_one_server_and_a_url_names_an_absolute_path(tmp_path: Path) -> None:
    from ditserve.engine.errors import ConfigError
    from ditserve.engine.server.config import ServerConfig
    from ditserve.engine.server.state import open_job_store

    first = SqliteBackend(tmp_path / "jobs.sqlite3", clock=time.time)
    with pytest.raises(ConfigError, match="in use by another ditserve server"):
        SqliteBackend(tmp_path / "jobs.sqlite3", clock=time.time)
    first.close()
    SqliteBackend(tmp_path / "jobs.sqlite3", clock=time.time).close()  # free again
    config = ServerConfig(video_dir=str(tmp_path / "v"), job_store="sqlite://relative/jobs.db")
    with pytest.raises(ConfigError, match="an absolute file path"):
        open_job_store(config, namespace="m")
    store = open_job_store(ServerConfig(video_dir=str(tmp_path / "v")), namespace="m")
    assert not store.shared and (tmp_path / "v" / "jobs.sqlite3").is_file()
    store.close()


def test_a_redis_that_lost_its_data_is_unavailable_once_then_serves_again(tmp_path: Path,
                                                                           request) -> None:
    import redis

    backends = Backends("redis", tmp_path, request)
    store = backends.open()
    store.add(spec(), "r")
    client = redis.Redis.from_url(request.getfixturevalue("redis_server").url)
    for key in client.scan_iter(f"ditserve:{{{backends.namespace}}}:*"):
        client.delete(key)  # what a Redis restarted without persistence holds: nothing
    client.close()
    with pytest.raises(StoreUnavailable, match="job queue is gone"):
        store.claim("replica-a", 30)
    assert store.claim("replica-a", 30) is None  # the queue is back, empty
    job_id = store.add(spec(), "r")["id"]
    assert store.claim("replica-a", 30).id == job_id
    store.close()


def test_consumers_of_replicas_gone_are_dropped_from_the_group(tmp_path: Path, request,
                                                               monkeypatch) -> None:
    """Each replica process reads under a name of its own; Redis would keep them all. A
    consumer holding a job (pending) stays whatever its idle time."""
    from ditserve.engine.server.jobs import redis_backend

    backends = Backends("redis", tmp_path, request)
    store = backends.open()
    store.add(spec(), "r")
    held = store.claim("replica-holding", 30)
    assert held is not None
    backend = store.backend
    # A replica that ran jobs (all done) and then went away: a consumer with none pending.
    backend._r.xgroup_createconsumer(backend._queue, redis_backend.GROUP, "replica-gone")
    names = {c["name"] for c in backend._r.xinfo_consumers(backend._queue, redis_backend.GROUP)}
    assert {"replica-holding", "replica-gone"} <= names
    monkeypatch.setattr(redis_backend, "GONE_CONSUMER_S", 0.0)
    backends.open().claim("replica-new", 30)  # a new replica's first look at the queue
    names = {c["name"] for c in backend._r.xinfo_consumers(backend._queue, redis_backend.GROUP)}
    assert "replica-gone" not in names and "replica-holding" in names
    for opened in backends.opened:
        opened.close()


def test_a_record_of_another_version_breaks_nothing_else(tmp_path: Path, request) -> None:
    """Mid-rollout a newer replica may write a record this one cannot read: the list and the
    metrics go on without it, and the job itself is the store's 503 (another replica may
    read it), never a 500 for the whole deployment."""
    import json

    backends = Backends("redis", tmp_path, request)
    store = backends.open()
    readable, newer = (store.add(spec(i), "r")["id"] for i in range(2))
    backend = store.backend
    record = json.loads(backend._r.get(backend._key(newer)))
    backend._r.set(backend._key(newer), json.dumps({**record, "schema": 2}))
    listed, _ = store.page(limit=10, after=None, order="desc")
    assert [job["id"] for job in listed] == [readable]
    counts, _ = store.usage()  # what /metrics reads
    assert counts["queued"] == 1
    with pytest.raises(StoreUnavailable, match="another replica may answer"):
        store.get(newer)
    assert store.get(readable)["id"] == readable
    for opened in backends.opened:
        opened.close()


def test_a_replica_with_a_shorter_lease_takes_no_job_a_longer_lease_still_holds(
        tmp_path: Path, request) -> None:
    """The lease goes by the longest any replica of the namespace holds jobs for: a replica
    started with a shorter --job-lease (mid-rollout) must not take a healthy replica's job."""
    backends = Backends("redis", tmp_path, request)
    patient, hasty = backends.open(), backends.open()
    job_id = patient.add(spec(), "r")["id"]
    held = patient.claim("replica-patient", 30)  # renews every 10 s
    assert held is not None and held.id == job_id
    backends.expire_leases()  # LEASE_S + 0.2 s without a renewal
    assert hasty.claim("replica-hasty", LEASE_S) is None  # its own lease ran out, not 30 s
    assert patient.job(job_id).owner == "replica-patient"
    for opened in backends.opened:
        opened.close()
