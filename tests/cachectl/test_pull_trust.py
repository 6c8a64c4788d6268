"""What a pull must not trust: the names a hub lists (a hostile or broken mirror must not write
or delete files outside the cache), an entry of the same key pulled through another endpoint
(a mirror that serves other bytes under the commit id), a pulled model whose bytes changed on
disk (the daemon's scrub finds it), and a daemon's earlier answer for a URI (a branch moves, a
request's own token must be checked). Against the local hub fixture; no network."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from model_sources import FILES, LocalHub, Repo

from ditserve.cachectl import pull_jobs
from ditserve.cachectl.errors import ModelDigestError, ModelNotFoundError, ModelSourceError
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.metrics import DaemonMetrics
from ditserve.cachectl.pull_jobs import PullCoordinator, PullStatus
from ditserve.cachectl.pulled_verify import verify_pulled_models
from ditserve.cachectl.pulls import PullRequest, pull
from ditserve.cachectl.scrub import Scrubber
from ditserve.cachectl.sources import Credentials
from ditserve.cachectl.store import CacheStore

WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture(autouse=True)
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # 127.0.0.1 only


@contextlib.contextmanager
def _serve(monkeypatch: pytest.MonkeyPatch, repos: dict[str, Repo]) -> Iterator[LocalHub]:
    with LocalHub(repos=repos).running() as running:
        monkeypatch.setenv("HF_ENDPOINT", running.url)
        yield running


@pytest.mark.parametrize("name", ["../escaped.txt", "a/../../escaped.txt", "/etc/escaped.txt",
                                  "a//b.txt", "./b.txt"])
def test_a_listed_name_that_leaves_the_folder_writes_and_deletes_nothing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> None:
    root = tmp_path / "deep" / "cache"
    victim = tmp_path / "deep" / "escaped.txt"
    victim.parent.mkdir()
    victim.write_text("precious")
    hostile = {"org/evil": Repo({"model_index.json": b"{}", name: b"hostile"})}
    with (_serve(monkeypatch, hostile),
          pytest.raises(ModelSourceError, match="would leave the model folder")):
        pull(root, PullRequest("hf://org/evil"))
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in tmp_path.rglob("*escaped*")) == ["escaped.txt"]
    assert not (root / "v1" / "models").exists() or not any((root / "v1" / "models").iterdir())


def test_a_name_that_is_also_a_folder_and_an_empty_repository_are_refused(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    repos = {"org/both": Repo({"x": b"file", "x/y.json": b"{}"}), "org/empty": Repo({})}
    with _serve(monkeypatch, repos):
        with pytest.raises(ModelSourceError, match="both as a file and as the folder"):
            pull(tmp_path / "cache", PullRequest("hf://org/both"))
        with pytest.raises(ModelNotFoundError, match="lists no files"):
            pull(tmp_path / "cache", PullRequest("hf://org/empty"))


def test_an_entry_pulled_through_another_endpoint_is_not_joined(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    poisoned = {**FILES, WEIGHTS: b"POISONED" * 4096}  # same commit id as the real hub's
    with _serve(monkeypatch, {"org/tiny": Repo(poisoned)}):
        first = pull(root, PullRequest("hf://org/tiny"))
    with (_serve(monkeypatch, {"org/tiny": Repo(dict(FILES))}),
          pytest.raises(ModelDigestError, match=f"cachectl rm {first.key}") as refused):
        pull(root, PullRequest("hf://org/tiny"))
    assert WEIGHTS in str(refused.value)
    with _serve(monkeypatch, {"org/tiny": Repo(poisoned)}):  # the same bytes: joined
        again = pull(root, PullRequest("hf://org/tiny"))
    assert (again.key, again.downloaded) == (first.key, False)


def test_the_scrub_and_verify_find_a_changed_byte_in_a_pulled_model(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with _serve(monkeypatch, {"org/tiny": Repo(dict(FILES))}):
        model = pull(tmp_path / "cache", PullRequest("hf://org/tiny"))
    weights = model.model_dir / WEIGHTS
    weights.chmod(0o644)
    data = bytearray(weights.read_bytes())
    data[100] ^= 1
    weights.write_bytes(bytes(data))
    store = CacheStore(tmp_path / "cache")
    metrics = DaemonMetrics(store)
    scrubber = Scrubber(store, metrics, logging.getLogger("test.scrub"), interval_s=0,
                        rate_bytes_per_s=None)
    (report,) = scrubber.scrub_once()
    assert report.key == model.key and report.status == "corrupt"
    assert any(p.file == f"model/{WEIGHTS}" and "SHA-256 mismatch" in p.what
               for p in report.problems)
    assert metrics.verify_failures._value.get() == 1
    assert report.bytes_hashed == sum(len(v) for v in FILES.values())
    (named,) = verify_pulled_models(Layout(tmp_path / "cache"), [model.key])
    assert named.status == "corrupt"


def _ready(coordinator: PullCoordinator, request: PullRequest) -> pull_jobs.PullJob:
    job = coordinator.submit(request)
    job.future.result(timeout=60)
    return job


def test_the_daemon_resolves_a_uri_again_once_its_answer_is_old_or_for_other_credentials(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    repos = {"org/tiny": Repo(dict(FILES)), "org/private": Repo(dict(FILES), token="hf_ok")}
    store = CacheStore(tmp_path / "cache")
    coordinator = PullCoordinator(store, logging.getLogger("test.pulls"))
    try:
        with _serve(monkeypatch, repos) as hub:
            first = _ready(coordinator, PullRequest("hf://org/tiny"))
            local = pull(tmp_path / "cache", PullRequest("hf://org/tiny")).to_json()
            answer = first.snapshot()  # `pull --json` through a daemon: the same fields
            assert {k: answer[k] for k in local if k != "downloaded"} == {
                k: v for k, v in local.items() if k != "downloaded"}
            assert _ready(coordinator, PullRequest("hf://org/tiny")) is first  # just finished
            allowed = _ready(coordinator, PullRequest("hf://org/private",
                                                      Credentials(hf_token="hf_ok")))
            assert allowed.status is PullStatus.READY
            refused = _ready(coordinator, PullRequest("hf://org/private",
                                                      Credentials(hf_token="hf_wrong")))
            assert (refused.status, refused.reason) == (PullStatus.FAILED, "Unauthorized")

            monkeypatch.setattr(pull_jobs, "READY_ANSWER_S", 0.0)
            hub.repos["org/tiny"] = Repo({**FILES, "extra.json": b"{}"}, commit="f" * 40)
            moved = _ready(coordinator, PullRequest("hf://org/tiny"))
            assert moved is not first and moved.status is PullStatus.READY
            assert moved.key != first.key  # the branch's new commit, not the old answer
    finally:
        coordinator.stop()


def test_a_pull_killed_before_its_rename_is_published_by_the_next_one_without_root(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import stat

    root = tmp_path / "cache"
    real_write_text = Path.write_text

    def as_a_non_root_writer(self: Path, *args: object, **kwargs: object) -> int:
        if self.exists() and not stat.S_IMODE(self.stat().st_mode) & 0o200:
            raise PermissionError(13, "Permission denied", str(self))  # no DAC override
        return real_write_text(self, *args, **kwargs)  # type: ignore[arg-type]

    with _serve(monkeypatch, {"org/tiny": Repo(dict(FILES))}):
        model = pull(root, PullRequest("hf://org/tiny"))
        # Back to the state a kill between the manifest's write and the rename leaves.
        partial = Layout(root).partial(model.key)
        partial.parent.mkdir(parents=True, exist_ok=True)
        model.path.rename(partial)
        assert not stat.S_IMODE((partial / "manifest.json").stat().st_mode) & 0o222
        monkeypatch.setattr(Path, "write_text", as_a_non_root_writer)
        again = pull(root, PullRequest("hf://org/tiny"))
    assert again.key == model.key and again.path.is_dir() and not partial.exists()


BIG = 24 << 20  # huggingface_hub writes a download in 10 MiB pieces: cancelled at a piece


def _slow_big_repo() -> dict[str, Repo]:
    from model_sources import weights

    return {"org/big": Repo({"model_index.json": b"{}", "big.safetensors": weights(BIG)})}


def _part_sizes(root: Path) -> list[int]:
    return [p.stat().st_size for p in root.glob(".partial/*/model/.incomplete/big.safetensors")]


def test_stopping_the_daemon_stops_its_download_and_frees_the_lock(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import time

    from ditserve.cachectl import locks

    root = tmp_path / "cache"
    coordinator = PullCoordinator(CacheStore(root), logging.getLogger("test.pulls"))
    with _serve(monkeypatch, _slow_big_repo()) as hub:
        hub.delay_s = 0.004  # per 64 KiB: about 1.5 s for the file
        job = coordinator.submit(PullRequest("hf://org/big"))
        while not (any(_part_sizes(root)) or job.future.done()):
            time.sleep(0.01)
        coordinator.stop()
        job.future.result(timeout=60)
        assert (job.status, job.reason) == (PullStatus.FAILED, "cancelled")
    (part,) = _part_sizes(root)
    assert 0 < part < BIG  # stopped mid-file, its bytes kept for the next pull
    layout = Layout(root)
    (key,) = [p.name for p in (root / ".partial").iterdir()]
    held = locks.acquire(layout.build_lock(key), shared=False, timeout_s=0)
    assert held is not None  # released: a --no-daemon pull or the next daemon goes on
    held.release()


def test_a_cancelled_pull_keeps_its_bytes_and_the_next_one_continues(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import threading
    import time

    from ditserve.cachectl.errors import PullCancelledError

    root = tmp_path / "cache"
    cancel = threading.Event()
    with _serve(monkeypatch, _slow_big_repo()) as hub:
        hub.delay_s = 0.004

        def cancel_at_the_first_piece() -> None:
            while not any(_part_sizes(root)):
                time.sleep(0.01)
            cancel.set()

        watcher = threading.Thread(target=cancel_at_the_first_piece, daemon=True)
        watcher.start()
        with pytest.raises(PullCancelledError, match="partial download is kept"):
            pull(root, PullRequest("hf://org/big"), cancel=cancel)
        (part,) = _part_sizes(root)
        assert 0 < part < BIG
        hub.delay_s = 0.0
        model = pull(root, PullRequest("hf://org/big"))
        assert model.downloaded
        assert hub.gets[-1].name == "big.safetensors" and hub.gets[-1].start == part
