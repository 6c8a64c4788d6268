"""The video job store and its directory, without an engine, on both real backends (SQLite
and a real redis-server): bounds by count and bytes (429 material, never eviction), expiry
after the TTL on an injected clock, atomic publication, one server per owned directory, and
the Range choice. Claims and leases: test_job_claims.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from ditserve.engine.errors import ConfigError
from ditserve.engine.request import SamplingParams
from ditserve.engine.server.jobs.errors import StoreFull
from ditserve.engine.server.jobs.files import VideoFiles
from ditserve.engine.server.jobs.model import VideoSpec
from ditserve.engine.server.jobs.sqlite_backend import SqliteBackend
from ditserve.engine.server.jobs.store import JobStore, StoreLimits
from ditserve.engine.server.videos.byte_ranges import Unsatisfiable, choose_range

_namespaces = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def spec(frames: int = 5, side: int = 16) -> VideoSpec:
    params = SamplingParams(prompt="p", height=side, width=side, num_frames=frames, seed=1)
    return VideoSpec(params=params, fps=8, model="m")


@pytest.fixture(params=["sqlite", "redis"])
def make_store(request, tmp_path: Path):
    """make_store(**limits) -> (JobStore, Clock) on the parametrized backend."""
    made: list[JobStore] = []

    def make(**limits: float) -> tuple[JobStore, Clock]:
        clock = Clock()
        root = tmp_path / f"videos{len(made)}"
        if request.param == "sqlite":
            files = VideoFiles(root)
            backend = SqliteBackend(root / "jobs.sqlite3", clock=clock)
        else:
            from ditserve.engine.server.jobs.redis_backend import RedisBackend

            url = request.getfixturevalue("redis_server").url
            files = VideoFiles(root, shared=True)
            backend = RedisBackend(url, namespace=f"test-{next(_namespaces)}-{tmp_path.name}")
        store = JobStore(StoreLimits(**limits), files, backend, clock=clock)  # type: ignore[arg-type]
        made.append(store)
        return store, clock

    yield make
    for store in made:
        store.close()


def run_one(store: JobStore, job_id: str, owner: str = "replica-a") -> str:
    """Claim ``job_id`` for ``owner`` (older queued jobs are handed back); its token."""
    others = []
    while (job := store.claim(owner, 30)) is not None and job.id != job_id:
        others.append(job)
    for other in others:
        assert other.token is not None and store.hand_back(other.id, other.token)
    assert job is not None and job.token is not None
    return job.token


def finish_one(store: JobStore, data: bytes = b"mp4 bytes") -> str:
    job_id = store.add(spec(), "rid")["id"]
    token = run_one(store, job_id)
    store.started(job_id, token, seed=1)
    store.stepped(job_id, token, 1)
    path, created = store.files.publish(job_id, data)
    assert created and store.complete(job_id, path, len(data))
    return job_id


def test_count_bound_refuses_and_never_evicts(make_store) -> None:
    store, clock = make_store(max_jobs=2, ttl_s=60)
    running = store.add(spec(), "a")["id"]
    done = finish_one(store)
    with pytest.raises(StoreFull) as refused:
        store.add(spec(), "c")
    assert refused.value.retry_after_s == 60  # the finished job expires in a minute
    assert store.get(done)["status"] == "completed"  # kept: it was promised until expiry
    assert store.get(running)["status"] == "queued"
    clock.now += 59
    with pytest.raises(StoreFull) as again:
        store.add(spec(), "c")
    assert again.value.retry_after_s == 1
    clock.now += 1
    assert store.add(spec(), "c")["status"] == "queued"  # the expired job made room
    assert store.get(done) is None


def test_retry_after_is_the_servers_when_only_running_jobs_fill_it(make_store) -> None:
    store, _ = make_store(max_jobs=1)
    store.add(spec(), "a")
    with pytest.raises(StoreFull) as refused:
        store.add(spec(), "b")
    assert refused.value.retry_after_s is None


def test_byte_bound_counts_reservations_then_real_sizes(make_store) -> None:
    one = spec().raw_bytes
    store, _ = make_store(max_bytes=2 * one)
    first = store.add(spec(), "a")["id"]
    second = store.add(spec(), "b")["id"]
    assert store.usage()[1] == 2 * one
    with pytest.raises(StoreFull, match="bytes free"):
        store.add(spec(), "c")
    path, _ = store.files.publish(first, b"x" * 100)
    store.complete(first, path, 100)  # the MP4's size replaces the reservation
    assert store.usage()[1] == one + 100
    with pytest.raises(StoreFull):
        store.add(spec(), "c")
    store.fail(second, "storage_full", "no space")  # a failed job holds no bytes
    assert store.usage()[1] == 100
    store.add(spec(), "c")
    counts, used = store.usage()
    assert (counts["completed"], counts["failed"], counts["queued"], used) == (1, 1, 1,
                                                                             100 + one)


def test_expiry_deletes_the_file_and_hides_the_job(make_store) -> None:
    store, clock = make_store(ttl_s=10)
    job_id = finish_one(store)
    path = store.files.path_of(job_id)
    assert path.read_bytes() == b"mp4 bytes"
    job = store.get(job_id)
    assert job["expires_at"] == job["completed_at"] + 10
    clock.now += 10
    assert store.get(job_id) is None and store.content(job_id) is None
    assert not path.exists()
    assert store.page(limit=10, after=None, order="desc") == ([], False)


def test_delete_removes_a_finished_job_and_cancels_then_removes_an_unfinished_one(
        make_store) -> None:
    store, _ = make_store()
    done = finish_one(store)
    running = store.add(spec(), "r")["id"]
    store.started(running, run_one(store, running, "replica-b"), seed=3)
    seen: list[dict] = []
    store.subscribe(running, seen.append)
    assert store.delete(done) == (True, None)
    assert not store.files.path_of(done).exists() and store.get(done) is None
    assert store.delete(running) == (True, "replica-b")  # that replica aborts it
    assert store.get(running) is None  # gone at once
    # Its follower saw it end as the API spells a cancelled job.
    assert [(j["status"], j["error"]["code"]) for j in seen] == [("failed", "cancelled")]
    assert store.delete(running) == (False, None)
    assert store.usage() == ({"queued": 0, "in_progress": 0, "completed": 0, "failed": 0,
                              "cancelled": 0}, 0)  # its reservation is released


def test_a_job_cancelled_while_encoding_keeps_no_file(make_store) -> None:
    store, _ = make_store()
    job_id = store.add(spec(), "a")["id"]
    store.cancel(job_id)
    path, created = store.files.publish(job_id, b"late")
    assert created and store.complete(job_id, path, 4) is False  # the caller removes it
    assert (store.get(job_id)["status"], store.get(job_id)["error"]["code"]) == (
        "failed", "cancelled")


def test_listeners_see_every_change_then_nothing(make_store) -> None:
    store, _ = make_store()
    seen: list[tuple[str, int]] = []
    job_id = store.add(spec(), "a")["id"]
    assert store.subscribe(job_id, lambda job: seen.append((job["status"], job["progress"])))
    token = run_one(store, job_id)
    store.started(job_id, token, seed=0)
    for step in (1, 1, 2):  # a repeated step is no change
        store.stepped(job_id, token, step)
    store.fail(job_id, "generation_failed", "boom", token=token)
    store.stepped(job_id, token, 3)
    assert seen == [("queued", 0), ("queued", 0), ("in_progress", 25), ("in_progress", 50),
                    ("failed", 50)]  # claimed, started (the seed), two steps, the end


def test_publication_is_atomic_and_a_directory_has_one_owner(tmp_path: Path) -> None:
    root = tmp_path / "videos"
    files = VideoFiles(root)
    kept, gone = "video_" + "1" * 32, "video_" + "3" * 32
    where, created = files.publish(kept, b"complete")
    path = Path(where)
    assert created and path.read_bytes() == b"complete" and path.parent == root
    assert list((root / ".tmp").iterdir()) == []  # the temp file was linked, not copied
    # A second claim of the same job publishing later keeps the first file.
    assert files.publish(kept, b"second") == (where, False)
    assert path.read_bytes() == b"complete" and list((root / ".tmp").iterdir()) == []
    files.publish(gone, b"a job the store no longer has")
    with pytest.raises(ConfigError, match="in use by another ditserve server"):
        VideoFiles(root)
    files.close()
    (root / "notes.txt").write_text("keep")
    (root / ".tmp" / "video_x.1.mp4").write_bytes(b"half")
    again = VideoFiles(root)  # the next server: half-written files are gone...
    again.sweep({kept})  # ...and so are the videos no job names
    assert sorted(p.name for p in root.iterdir()) == [".lock", ".tmp", "notes.txt",
                                                      f"{kept}.mp4"]
    assert list((root / ".tmp").iterdir()) == []
    again.close()
    shared = [VideoFiles(root, shared=True) for _ in range(2)]  # replicas on one volume
    shared[0].sweep(set())  # never sweeps: other replicas' files are theirs
    assert (root / f"{kept}.mp4").is_file()
    # A server started there with a store of its own (a forgotten --job-store) would sweep
    # away every video the shared store's jobs name: it is refused instead.
    with pytest.raises(ConfigError, match="holds the videos of replicas sharing a job store"):
        VideoFiles(root)
    assert (root / f"{kept}.mp4").is_file()
    for files in shared:
        files.close()


def test_a_private_directory_goes_away_at_close(tmp_path: Path) -> None:
    files = VideoFiles(None)
    files.publish("video_" + "2" * 32, b"x")
    files.close()
    assert not files.root.exists()


@pytest.mark.parametrize(("header", "if_range", "chosen"), [
    (None, None, None),
    ("bytes=0-9", None, (0, 10)),
    ("bytes=10-", None, (10, 100)),
    ("bytes=-30", None, (70, 100)),
    ("bytes=-300", None, (0, 100)),
    ("bytes=90-200", None, (90, 100)),
    ("bytes=100-", None, Unsatisfiable(100)),
    ("bytes=-0", None, Unsatisfiable(100)),
    ("bytes=9-3", None, None),  # invalid: ignored
    ("bytes=0-1,4-5", None, None),  # several ranges: the whole file
    ("items=0-1", None, None),
    ("bytes=0-9", '"etag"', (0, 10)),
    ("bytes=0-9", '"changed"', None),
])
def test_choose_range(header, if_range, chosen) -> None:
    assert choose_range(header, 100, if_range=if_range, etag='"etag"') == chosen


def test_publication_without_hard_links_renames(tmp_path: Path, monkeypatch) -> None:
    """A share that refuses hard links (EPERM) still gets the file, atomically renamed; a
    second claim's later file does not replace it."""
    import errno
    import os

    def no_links(src: object, dst: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    files = VideoFiles(tmp_path / "videos", shared=True)
    job_id = "video_" + "4" * 32
    where, created = files.publish(job_id, b"first")
    path = Path(where)
    assert created and path.read_bytes() == b"first"
    assert files.publish(job_id, b"second") == (where, False)
    assert path.read_bytes() == b"first" and list((files.root / ".tmp").iterdir()) == []
    files.close()
