"""Pulls through the node daemon: three pods' `cachectl pull --daemon-only` download once, a
daemon killed mid-download resumes after its restart, failures keep their reason, and the
node status shows progress. Real `cachectl serve` processes against the local hub fixture."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from model_sources import FILES, LocalHub, Repo

from ditserve.cachectl.client import DaemonClient
from ditserve.cachectl.entry_info import PULLED, EntryInfo
from ditserve.cachectl.node_status import model_rows
from ditserve.cachectl.pull_jobs import PullJob, PullStatus
from ditserve.cachectl.pulls import PullRequest

BIG = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture
def hub() -> Iterator[LocalHub]:
    fixture = LocalHub(repos={"org/tiny": Repo(dict(FILES)),
                                "org/private": Repo(dict(FILES), token="hf_secret")})
    with fixture.running() as running:
        yield running


def _env(hub: LocalHub, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    return {**env, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url, **extra}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ditserve.cachectl.cli", *args]


class Daemon:
    def __init__(self, root: Path, sock: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(_cli("serve", "--root", str(root), "--socket", str(sock),
                                          "--scrub-interval", "0"),
                                     stderr=subprocess.PIPE, text=True, env=env)
        assert self.proc.stderr is not None
        for line in self.proc.stderr:  # listening once daemon_started is logged
            if line.startswith("{") and json.loads(line)["event"] == "daemon_started":
                break

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    started: list[Daemon] = []
    yield started
    for d in started:
        d.stop()


def _pull(root: Path, sock: Path, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(_cli("pull", "--root", str(root), "--socket", str(sock), "--json",
                                 *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


@pytest.mark.slow
def test_three_pods_pull_once_through_the_daemon_and_resume_after_a_kill(
        hub: LocalHub, tmp_path: Path, daemons: list[Daemon]) -> None:
    root, sock = tmp_path / "cache", tmp_path / "run" / "cachectl.sock"
    env = _env(hub)
    daemons.append(Daemon(root, sock, env))
    hub.delay_s = 0.1
    first = _pull(root, sock, env, "--daemon-only", "hf://org/tiny")
    deadline = time.monotonic() + 60
    while hub.served[BIG] < 128 * 1024:
        assert time.monotonic() < deadline, "the daemon never started downloading"
        time.sleep(0.02)
    # The daemon's status shows the running download with its bytes so far.
    status, body = DaemonClient(sock).request("POST", "/v1/pull", {"uri": "hf://org/tiny"})
    assert status == 202 and body["status"] == "downloading"
    assert body["progress"]["total_bytes"] == sum(len(d) for d in FILES.values())

    daemons[0].stop()  # killed mid-download: the pod keeps waiting for a daemon
    partial = hub.served[BIG]
    assert partial < len(FILES[BIG])
    # What the killed daemon left of the big file (huggingface_hub writes 10 MiB at a time, so
    # for this small file usually nothing; tests/test_bench_model_delivery.py resumes a big one).
    have = sum(p.stat().st_size for p in (root / ".partial").rglob("*")
               if p.as_posix().endswith(BIG))
    restarted = len(hub.gets)
    hub.delay_s = 0.02
    daemons.append(Daemon(root, sock, env))
    others = [_pull(root, sock, env, "--daemon-only", "hf://org/tiny") for _ in range(2)]
    results = []
    for p in (first, *others):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    assert {r["key"] for r in results} == {results[0]["key"]}
    assert all(r["via"] == "daemon" for r in results)
    assert (Path(results[0]["model_dir"]) / BIG).read_bytes() == FILES[BIG]
    # Downloaded once per node: the restarted daemon fetched the big file from where its bytes
    # on disk ended, once for the three pods, and the small files once.
    again = [(g.start, g.sent) for g in hub.gets[restarted:] if g.name == BIG]
    assert again == [(have, len(FILES[BIG]) - have)]
    assert hub.served["model_index.json"] == len(FILES["model_index.json"])


def test_failures_keep_their_reason_and_tokens_travel_with_the_request(
        hub: LocalHub, tmp_path: Path, daemons: list[Daemon]) -> None:
    root, sock = tmp_path / "cache", tmp_path / "run" / "cachectl.sock"
    daemons.append(Daemon(root, sock, _env(hub)))  # the daemon itself has no token
    missing = _pull(root, sock, _env(hub), "hf://org/none")
    _, err = missing.communicate(timeout=60)
    assert missing.returncode == 3 and "no repository org/none" in err
    denied = _pull(root, sock, _env(hub), "hf://org/private")
    _, err = denied.communicate(timeout=60)
    assert denied.returncode == 3 and "refused access (401)" in err
    status, body = DaemonClient(sock).request("POST", "/v1/pull",
                                              {"uri": "hf://org/private", "wait_s": 30})
    assert (status, body["reason"]) == (403, "Unauthorized")
    allowed = _pull(root, sock, _env(hub, HF_TOKEN="hf_secret"), "hf://org/private")
    out, err = allowed.communicate(timeout=60)
    assert allowed.returncode == 0, err
    assert json.loads(out)["via"] == "daemon"
    status, body = DaemonClient(sock).request("POST", "/v1/pull", {"uri": "ftp://x"})
    assert status == 400 and "hf://org/repo" in body["error"]


def test_node_status_rows_show_downloads_with_progress_and_failures() -> None:
    running = PullJob("hf://org/a", PullRequest("hf://org/a"), phase="downloading",
                      done_bytes=10, total_bytes=40)
    failed = PullJob("s3://b/p", PullRequest("s3://b/p"), status=PullStatus.FAILED,
                     reason="NotFound", error="no objects under 'p/'")
    done = PullJob("hf://org/c", PullRequest("hf://org/c"), status=PullStatus.READY, key="k" * 64)
    on_disk = [EntryInfo("k" * 64, Path("k" * 64), 99, None, 0.0, False, None, kind=PULLED,
                         uri="hf://org/c")]
    rows = model_rows(on_disk, [running, failed, done], previous=None, now="T0")
    by_uri: dict[str, Any] = {r["uri"]: r for r in rows}
    assert by_uri["hf://org/a"] == {"state": "Downloading", "uri": "hf://org/a", "doneBytes": 10,
                                    "totalBytes": 40, "message": "downloading", "since": "T0"}
    assert by_uri["s3://b/p"]["state"] == "Failed"
    assert by_uri["s3://b/p"]["message"].startswith("NotFound: no objects")
    assert by_uri["hf://org/c"] == {"state": "Ready", "uri": "hf://org/c", "key": "k" * 64,
                                    "bytes": 99, "inUse": False, "since": "T0"}
    again = model_rows(on_disk, [running], previous={"models": rows}, now="T1")
    assert {r["uri"]: r["since"] for r in again} == {"hf://org/a": "T0", "hf://org/c": "T0"}
