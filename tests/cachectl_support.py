"""Helpers shared by the cachectl tests and their child processes (numpy only, no torch)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ditserve.cachectl.identity import EntryIdentity, identity_for

CHILD = Path(__file__).parent / "cachectl" / "cache_child.py"


def make_identity(seed: int = 0, **overrides: Any) -> EntryIdentity:
    args: dict[str, Any] = {"model_digest": f"{seed:064x}", "dtype": "float32",
                            "loader": "tests.synthetic", "loader_version": "1"}
    args.update(overrides)
    return identity_for(**args)


def synthetic_tensors(seed: int = 0, n: int = 4, size: int = 4096) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {f"blocks.{i}.weight": rng.standard_normal((size // 64, 64),
                                                                           dtype=np.float32)
                                  for i in range(n)}
    out["step"] = np.arange(3, dtype=np.int64)
    return out


class Child:
    """A child process running cachectl/cache_child.py; talks in JSON lines on stdout."""

    def __init__(self, *args: str, wrap: list[str] | None = None) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, str(CHILD), *args]
        if wrap is not None:  # e.g. in a namespace: the last item of wrap is a shell snippet
            argv = [*wrap[:-1], f"{wrap[-1]} {shlex.join(argv)}"]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env)

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"child exited without output: {err}")
        return json.loads(line)

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill9(self) -> None:
        self.proc.kill()  # SIGKILL: no cleanup code runs in the child
        self.proc.wait()

    def finish(self) -> int:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        return self.proc.wait(timeout=60)


# ---- a light model loader (numpy only) for CLI and daemon processes -----------------------
# Selected in a child process with DITSERVE_CACHECTL_LOADER=cachectl_support:LIGHT_LOADER (and
# this directory on PYTHONPATH). A model is a directory with transformer/weights.bin; its
# tensors are derived from those bytes. If the model directory holds a file "hold", a build
# announces itself (started.<pid>) and waits until a file "release" appears.

def make_light_model(path: Path, seed: int = 0, size: int = 64 * 1024) -> Path:
    (path / "transformer").mkdir(parents=True, exist_ok=True)
    (path / "transformer" / "config.json").write_text(json.dumps({"seed": seed}))
    rng = np.random.default_rng(seed)
    (path / "transformer" / "weights.bin").write_bytes(rng.bytes(size))
    return path


def _light_source_files(model_dir: Path, component: str = "transformer") -> list[Path]:
    folder = Path(model_dir) / "transformer"
    if not (folder / "weights.bin").is_file():
        raise FileNotFoundError(f"{folder} has no weights.bin")
    return sorted(p for p in folder.iterdir() if p.is_file())


def _light_load(model_dir: Path, dtype: str, component: str = "transformer") -> dict[str, Any]:
    import time

    model_dir = Path(model_dir)
    if (model_dir / "hold").exists():
        (model_dir / f"started.{os.getpid()}").write_text("")
        deadline = time.monotonic() + 120
        while not (model_dir / "release").exists():  # the test's signal, polled
            if time.monotonic() > deadline:
                raise TimeoutError("the test never released the build")
            time.sleep(0.01)
    raw = np.frombuffer((model_dir / "transformer" / "weights.bin").read_bytes(), dtype=np.uint8)
    as_float = raw.astype(np.float32 if dtype == "float32" else np.float16) / 255
    return {"blocks.0.weight": as_float.reshape(-1, 64), "blocks.1.bias": as_float[:64].copy()}


def _light_loader() -> Any:
    from ditserve.cachectl.model_build import ModelLoader

    return ModelLoader(name="tests.light_loader", version="1",
                       source_files=_light_source_files, load=_light_load)


LIGHT_LOADER = _light_loader()
LIGHT_ENV = {"DITSERVE_CACHECTL_LOADER": "cachectl_support:LIGHT_LOADER",
             "PYTHONPATH": str(Path(__file__).parent)}


def cachectl_argv(*args: str) -> list[str]:
    """A real ``cachectl`` process (run with LIGHT_ENV for the light loader)."""
    return [sys.executable, "-m", "ditserve.cachectl.cli", *args]


def light_env(**extra: str) -> dict[str, str]:
    return {**os.environ, **LIGHT_ENV, **extra}


# ---- mounts in a private mount namespace (read-only views, tiny filesystems) --------------
# CI runs as root: there these tests must run, never skip. Elsewhere they need root too.

def _unshare_works() -> bool:
    import shutil

    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                           capture_output=True)
    return probe.returncode == 0


def can_mount() -> bool:
    import shutil

    return os.geteuid() == 0 and shutil.which("mount") is not None


def require_mounts() -> None:
    import pytest

    if can_mount():
        return
    if os.environ.get("CI"):
        pytest.fail("CI runs as root and must be able to mount for this test")
    pytest.skip("needs root to mount (a read-only bind mount, a tiny tmpfs)")


def in_mount_namespace(mounts: list[str], argv: list[str], *, env: dict[str, str] | None = None,
                       timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` after ``mounts`` (shell commands, each a mount whose last word is its mount
    point), in a private mount namespace where ``unshare -m`` works (else in this one), and
    unmount them again before leaving."""
    points = list(dict.fromkeys(shlex.split(m)[-1] for m in mounts if m.split()[0] == "mount"))
    teardown = "; ".join(f"umount {shlex.quote(p)} 2>/dev/null" for p in reversed(points))
    script = (f"set -e; {'; '.join(mounts)}; set +e; {shlex.join(argv)}; rc=$?; "
              f"{teardown or 'true'}; exit $rc")
    if _unshare_works():
        cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", script]
    else:  # the host namespace: the script unmounts on every path but a kill of the shell
        script = f"trap '{teardown or 'true'}' EXIT; " + script
        cmd = ["sh", "-c", script]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def read_only_bind(source: Path, target: Path) -> list[str]:
    """The two mounts of a read-only view of ``source`` at ``target`` (refuses even root)."""
    target.mkdir(parents=True, exist_ok=True)
    return [f"mount --bind {shlex.quote(str(source))} {shlex.quote(str(target))}",
            f"mount -o remount,bind,ro {shlex.quote(str(target))}"]


def without_file_permissions_bypass(argv: list[str]) -> list[str]:
    """``argv`` run so that file permissions apply: as root (CI), without the capabilities
    that bypass them; as another user, as is. Skips (outside CI) if that cannot be done."""
    import shutil

    import pytest

    if os.geteuid() != 0:
        return argv
    if shutil.which("setpriv") is None:
        if os.environ.get("CI"):
            pytest.fail("CI runs as root and needs setpriv (util-linux) for this test")
        pytest.skip("needs setpriv to drop root's permission bypass")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--", *argv]
