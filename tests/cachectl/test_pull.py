"""``cachectl pull`` against a local hub-compatible server and moto's S3 server: the entry is
published once, checked against the source's digests and its own manifest, resumed after a
kill, and failures (404, 401, digest, disk) say what is wrong. No network beyond 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from model_sources import FILES, LocalHub, Repo, moto_s3, weights
from ports import free_port

from ditserve.cachectl import pulls
from ditserve.cachectl.errors import (
    EntryCorruptError,
    InsufficientSpaceError,
    ModelAccessError,
    ModelDigestError,
    ModelNotFoundError,
    UsageError,
)
from ditserve.cachectl.layout import Layout
from ditserve.cachectl.model_uri import parse_model_uri
from ditserve.cachectl.pulled import check_model_entry
from ditserve.cachectl.pulls import PullRequest, pull
from ditserve.cachectl.sources import Credentials


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalHub]:
    from huggingface_hub import constants

    # tests/conftest.py sets HF_HUB_OFFLINE=1 for everything else; a pull is explicit network
    # use (here only to 127.0.0.1).
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    fixture = LocalHub(repos={"org/tiny": Repo(dict(FILES)),
                                "org/private": Repo(dict(FILES), token="hf_secret")})
    with fixture.running() as running:
        monkeypatch.setenv("HF_ENDPOINT", running.url)
        yield running


def _files(model_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(model_dir).as_posix(): p.read_bytes()
            for p in model_dir.rglob("*") if p.is_file()}


def _published(root: Path) -> list[str]:
    models = Layout(root).models
    return sorted(p.name for p in models.iterdir()) if models.is_dir() else []


def test_uri_parsing() -> None:
    assert parse_model_uri("hf://org/repo@v1.0").revision == "v1.0"
    assert str(parse_model_uri("hf://org/repo")) == "hf://org/repo"
    s3 = parse_model_uri("s3://my-bucket/models/flux")
    assert (s3.bucket, s3.key_prefix) == ("my-bucket", "models/flux/")
    for bad in ("http://x/y", "hf://onlyname", "hf://org/repo@..", "s3://UPPER/x", "s3://b/../x"):
        with pytest.raises(UsageError):
            parse_model_uri(bad)


def test_hf_pull_publishes_an_exact_checked_copy_and_joins_it_again(hub: LocalHub,
                                                                      tmp_path: Path) -> None:
    root = tmp_path / "cache"
    phases: list[str] = []
    model = pull(root, PullRequest("hf://org/tiny"), on_phase=phases.append)
    assert model.downloaded and model.revision == hub.repos["org/tiny"].commit
    assert _files(model.model_dir) == FILES  # nothing of huggingface_hub's bookkeeping left
    assert check_model_entry(model.path, full=True) == []
    manifest = json.loads((model.path / "manifest.json").read_text())
    by_name = {f["name"]: f for f in manifest["files"]}
    big = "transformer/diffusion_pytorch_model.safetensors"
    assert by_name[big]["sha256"] == hashlib.sha256(FILES[big]).hexdigest()
    assert by_name[big]["source_digest"]["algorithm"] == "sha256"
    assert by_name["model_index.json"]["source_digest"]["algorithm"] == "git-sha1"
    assert {"resolving", "downloading", "checking digests", "publishing"} <= set(phases)
    assert not any(Layout(root).partials.iterdir())  # the partial folder became the entry

    served = sum(hub.served.values())
    again = pull(root, PullRequest("hf://org/tiny@main"))  # a branch: the same commit
    assert (again.key, again.downloaded) == (model.key, False)
    assert sum(hub.served.values()) == served  # joined: not one more byte downloaded


def test_hf_errors_say_what_is_wrong(hub: LocalHub, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    with pytest.raises(ModelNotFoundError, match="no repository org/missing"):
        pull(root, PullRequest("hf://org/missing"))
    with pytest.raises(ModelNotFoundError, match="revision 'nope' does not exist"):
        pull(root, PullRequest("hf://org/tiny@nope"))
    with pytest.raises(ModelAccessError, match="HF_TOKEN") as e:
        pull(root, PullRequest("hf://org/private"))
    assert e.value.reason == "Unauthorized"
    model = pull(root, PullRequest("hf://org/private", Credentials(hf_token="hf_secret")))
    assert _files(model.model_dir) == FILES


def test_a_byte_corrupted_in_transit_is_downloaded_again(hub: LocalHub,
                                                          tmp_path: Path) -> None:
    big = "transformer/diffusion_pytorch_model.safetensors"
    hub.corrupt[big] = 1
    model = pull(tmp_path / "cache", PullRequest("hf://org/tiny"))
    assert _files(model.model_dir)[big] == FILES[big]
    assert hub.corrupt[big] == 0


def test_a_file_corrupted_twice_fails_and_publishes_nothing(hub: LocalHub,
                                                            tmp_path: Path) -> None:
    root = tmp_path / "cache"
    hub.corrupt["vae/diffusion_pytorch_model.safetensors"] = 2
    with pytest.raises(ModelDigestError, match="vae/diffusion_pytorch_model.safetensors"):
        pull(root, PullRequest("hf://org/tiny"))
    assert _published(root) == []
    # The bad file was deleted, the good ones kept: the next pull fetches only the bad one.
    served = dict(hub.served)
    pull(root, PullRequest("hf://org/tiny"))
    fetched_again = {n for n, b in hub.served.items() if b != served.get(n, 0)}
    assert fetched_again == {"vae/diffusion_pytorch_model.safetensors"}


def test_verify_finds_a_byte_flipped_on_disk(hub: LocalHub, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    model = pull(root, PullRequest("hf://org/tiny"))
    target = model.model_dir / "transformer/diffusion_pytorch_model.safetensors"
    os.chmod(target, 0o644)
    with open(target, "r+b") as f:
        f.seek(1234)
        byte = f.read(1)
        f.seek(1234)
        f.write(bytes([byte[0] ^ 1]))
    problems = check_model_entry(model.path, full=True)
    assert [p.file for p in problems] == ["model/transformer/diffusion_pytorch_model.safetensors"]
    assert "SHA-256 mismatch" in problems[0].what
    cli = _cli(root, "verify")
    assert cli.returncode == 1 and "CORRUPT" in cli.stdout, cli.stdout + cli.stderr
    # A truncated file breaks the structure: a later pull refuses it instead of pulling over.
    os.truncate(target, 10)
    with pytest.raises(EntryCorruptError):
        pull(root, PullRequest("hf://org/tiny"))


def test_disk_full_is_caught_before_downloading(hub: LocalHub, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.statvfs

    class Full:
        def __init__(self, path: str) -> None:
            st = real(path)
            self.f_frsize, self.f_bavail = st.f_frsize, 1
            self.f_files, self.f_favail = st.f_files, st.f_favail

    monkeypatch.setattr(pulls.os, "statvfs", Full)
    with pytest.raises(InsufficientSpaceError, match="cachectl gc"):
        pull(tmp_path / "cache", PullRequest("hf://org/tiny"))
    assert sum(hub.served.values()) == 0


def test_inodes_that_run_out_are_named_as_inodes(hub: LocalHub, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.statvfs
    left = {"inodes": 3}

    class FewInodes:
        def __init__(self, path: str) -> None:
            st = real(path)
            self.f_frsize, self.f_bavail = st.f_frsize, st.f_bavail
            self.f_files, self.f_favail = 1000, left["inodes"]

    monkeypatch.setattr(pulls.os, "statvfs", FewInodes)
    with pytest.raises(InsufficientSpaceError, match="free inodes, 3 left") as preflight:
        pull(tmp_path / "cache", PullRequest("hf://org/tiny"))
    assert preflight.value.unit == "inodes" and sum(hub.served.values()) == 0

    left["inodes"] = 10**6  # the preflight passes; then the filesystem runs out (ENOSPC)
    real_mkdir = Path.mkdir

    def out_of_inodes(self: Path, *args: object, **kwargs: object) -> None:
        if ".incomplete" in self.parts:
            left["inodes"] = 0
            raise OSError(28, "No space left on device", str(self))
        real_mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "mkdir", out_of_inodes)
    with pytest.raises(InsufficientSpaceError, match="free inodes, 0 left") as during:
        pull(tmp_path / "cache", PullRequest("hf://org/tiny"))
    assert during.value.unit == "inodes"


def _cli(root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ditserve.cachectl.cli", "--root", str(root),
                           *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "0", **(env or {})})


def _popen(root: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "ditserve.cachectl.cli", "--root", str(root),
                             "pull", "--no-daemon", "--json", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "0"})


@pytest.mark.slow
def test_three_pulls_at_once_download_once(hub: LocalHub, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    hub.delay_s = 0.02  # long enough that the three overlap
    procs = [_popen(root, "hf://org/tiny") for _ in range(3)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    assert len({r["key"] for r in results}) == 1
    assert sorted(r["downloaded"] for r in results) == [False, False, True]
    assert dict(hub.served) == {name: len(data) for name, data in FILES.items()}


def _big_on_disk(folder: Path) -> int:
    """Bytes of the partial pull's copy of the one big file, whatever it is called there."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()
               and p.stat().st_size > 2**20)


@pytest.mark.slow
def test_a_killed_pull_resumes_where_it_stopped(hub: LocalHub, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    big = "transformer/diffusion_pytorch_model.safetensors"
    # Bigger than huggingface_hub's 10 MiB write chunk, so a kill leaves bytes to resume from.
    files = {**FILES, big: weights(12 * 2**20, 7)}
    hub.repos["org/big"] = Repo(files)
    hub.hold(big, 11 * 2**20)
    proc = _popen(root, "hf://org/big")
    deadline = time.monotonic() + 60
    while not hub.held(big):
        assert time.monotonic() < deadline and proc.poll() is None, "never reached the hold"
        time.sleep(0.02)
    while _big_on_disk(root / ".partial") < 10 * 2**20:  # the received chunk written
        assert time.monotonic() < deadline, "nothing of the big file reached the disk"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    have = _big_on_disk(root / ".partial")
    assert _published(root) == []
    restarted = len(hub.gets)
    hub.release()
    done = _cli(root, "pull", "--no-daemon", "--json", "hf://org/big")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (Path(result["model_dir"]) / big).read_bytes() == files[big]
    # Resumed: one GET of the big file, from the first byte not on disk, sending the rest.
    again = [g for g in hub.gets[restarted:] if g.name == big]
    assert [(g.start, g.sent) for g in again] == [(have, len(files[big]) - have)]


def test_a_flipped_byte_in_a_resumed_partial_file_is_caught(hub: LocalHub,
                                                            tmp_path: Path) -> None:
    """What a killed pull left is trusted only as far as the digest check: a byte flipped in it
    (on disk, before the resume) fails the file's SHA-256, and the file is fetched whole."""
    big = "transformer/diffusion_pytorch_model.safetensors"
    files = {**FILES, big: weights(3 * 2**20, 8)}
    hub.repos["org/big"] = Repo(files)
    key = pull(tmp_path / "first", PullRequest("hf://org/big")).key
    root = tmp_path / "cache"
    partial = Layout(root).partial(key) / "model" / ".incomplete" / big
    partial.parent.mkdir(parents=True)
    left = bytearray(files[big][:2**20])
    left[1234] ^= 0x01
    partial.write_bytes(bytes(left))
    before = len(hub.gets)
    model = pull(root, PullRequest("hf://org/big"))
    assert (model.model_dir / big).read_bytes() == files[big]
    assert check_model_entry(model.path, full=True) == []
    # Resumed from the partial file's end, caught by the digest, then fetched from byte 0.
    assert [(g.start, g.sent) for g in hub.gets[before:] if g.name == big] == [
        (2**20, 2 * 2**20), (0, 3 * 2**20)]


def test_cli_pull_links_the_model_and_exits_3_on_404(hub: LocalHub, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    link = tmp_path / "run" / "model"
    ok = _cli(root, "pull", "--no-daemon", "--link", str(link), "hf://org/tiny")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ready ") and "(downloaded)" in ok.stdout
    assert (link / "model_index.json").read_bytes() == FILES["model_index.json"]
    missing = _cli(root, "pull", "--no-daemon", "hf://org/gone")
    assert missing.returncode == 3 and "no repository org/gone" in missing.stderr
    bad = _cli(root, "pull", "ftp://x/y")
    assert bad.returncode == 2 and "hf://org/repo" in bad.stderr


def test_an_unreachable_hub_is_a_source_error_not_a_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    from ditserve.cachectl.errors import ModelSourceError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("HF_ENDPOINT", nobody)
    with pytest.raises(ModelSourceError, match=f"cannot reach {nobody}") as e:
        pull(tmp_path / "cache", PullRequest("hf://org/tiny"))
    assert e.value.reason == "SourceError"
    cli = _cli(tmp_path / "cache", "pull", "--no-daemon", "hf://org/tiny")
    assert cli.returncode == 3, cli.stderr
    assert "cannot reach" in cli.stderr and "Traceback" not in cli.stderr


def test_a_link_from_a_relative_root_points_at_the_model(hub: LocalHub, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ok = _cli(Path("cache"), "pull", "--no-daemon", "--link", "run/model", "hf://org/tiny")
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "run" / "model" / "model_index.json").read_bytes() == \
        FILES["model_index.json"]


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    import boto3

    with moto_s3() as env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        client = boto3.client("s3")
        client.create_bucket(Bucket="models")
        for name, data in FILES.items():
            client.put_object(Bucket="models", Key=f"flux/{name}", Body=data,
                              ChecksumAlgorithm="SHA256")
        client.put_object(Bucket="models", Key="flux-other/x.json", Body=b"{}")
        yield client


def _s3_credentials() -> Credentials:
    from ditserve.cachectl.pull_command import credentials_from_env

    return credentials_from_env()


def test_s3_pull_checks_checksums_and_joins_the_same_listing(s3: object, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    model = pull(root, PullRequest("s3://models/flux", _s3_credentials()))
    assert _files(model.model_dir) == FILES  # the prefix is a folder: flux-other stays out
    manifest = json.loads((model.path / "manifest.json").read_text())
    assert {f["source_digest"]["algorithm"] for f in manifest["files"]} == {"sha256-b64"}
    assert pull(root, PullRequest("s3://models/flux/", _s3_credentials())).key == model.key
    # A re-uploaded object changes the listing: a new entry, never a stale one.
    s3.put_object(Bucket="models", Key="flux/model_index.json", Body=b"{}")  # type: ignore[attr-defined]
    assert pull(root, PullRequest("s3://models/flux", _s3_credentials())).key != model.key


def test_s3_resumes_a_partial_object_and_reports_missing_sources(s3: object,
                                                                 tmp_path: Path) -> None:
    root = tmp_path / "cache"
    big = "transformer/diffusion_pytorch_model.safetensors"
    creds = _s3_credentials()
    from ditserve.cachectl.pulled import model_key
    from ditserve.cachectl.s3_source import INCOMPLETE, S3Source

    snapshot = S3Source(parse_model_uri("s3://models/flux"), creds).resolve()
    partial = Layout(root).partial(model_key(snapshot.identity)) / "model" / INCOMPLETE / big
    partial.parent.mkdir(parents=True)
    partial.write_bytes(FILES[big][:100_000])  # what a killed pull left
    model = pull(root, PullRequest("s3://models/flux", creds))
    assert (model.model_dir / big).read_bytes() == FILES[big]
    with pytest.raises(ModelNotFoundError, match="no objects under"):
        pull(root, PullRequest("s3://models/nothing-here", creds))
    with pytest.raises(ModelNotFoundError):
        pull(root, PullRequest("s3://no-such-bucket/x", creds))


def test_a_read_only_cache_joins_but_never_downloads(hub: LocalHub, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from ditserve.cachectl.errors import ReadOnlyCacheError

    root = tmp_path / "cache"
    pull(root, PullRequest("hf://org/tiny"))

    def read_only(self: Layout) -> None:  # an engine pod's mount (tests run as root)
        raise OSError(errno.EROFS, "Read-only file system", str(self.root))

    monkeypatch.setattr(Layout, "create", read_only)
    assert not pull(root, PullRequest("hf://org/tiny")).downloaded  # a join writes nothing
    with pytest.raises(ReadOnlyCacheError, match="read-only"):
        pull(root, PullRequest("hf://org/private", Credentials(hf_token="hf_secret")))


def test_a_read_only_mount_of_an_existing_cache_is_read_only_at_the_lock(
        hub: LocalHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from ditserve.cachectl import locks
    from ditserve.cachectl.errors import ReadOnlyCacheError

    root = tmp_path / "cache"
    pull(root, PullRequest("hf://org/tiny"))  # the cache exists: creating it writes nothing

    def lock_file_refused(path: Path, **_kw: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(locks, "acquire", lock_file_refused)
    with pytest.raises(ReadOnlyCacheError, match="read-only"):
        pull(root, PullRequest("hf://org/private", Credentials(hf_token="hf_secret")))


def test_a_link_that_cannot_be_made_is_a_message_and_exit_3(hub: LocalHub,
                                                            tmp_path: Path) -> None:
    root = tmp_path / "cache"
    taken = tmp_path / "run"
    (taken / "model").mkdir(parents=True)
    cli = _cli(root, "pull", "--no-daemon", "--link", str(taken / "model"), "hf://org/tiny")
    assert cli.returncode == 3, cli.stderr
    assert "is a directory" in cli.stderr and "Traceback" not in cli.stderr
    assert sorted(p.name for p in taken.iterdir()) == ["model"]  # no temporary link left
    under_a_file = tmp_path / "a-file"
    under_a_file.write_text("")
    cli = _cli(root, "pull", "--no-daemon", "--link", str(under_a_file / "model"),
               "hf://org/tiny")
    assert cli.returncode == 3 and "cannot link" in cli.stderr and "Traceback" not in cli.stderr
