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
