"""A fatal start error reaches Kubernetes: `ditserve serve` writes it to the termination log
(the container's terminationMessagePath), which the operator reads into the deployment's
status; outside a pod (no such file) nothing is written anywhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ditserve.engine.termination import MAX_BYTES, record_fatal


def _serve(tmp_path: Path, log: Path) -> subprocess.CompletedProcess[str]:
    env = {"DITSERVE_TERMINATION_LOG": str(log), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "ditserve.engine.cli", "serve", "--model",
                           str(tmp_path / "missing-model")], capture_output=True, text=True,
                          env=env, timeout=120)


def test_a_start_error_is_the_containers_termination_message(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.write_text("")  # the kubelet creates the file before the container starts
    done = _serve(tmp_path, log)
    assert done.returncode == 2
    said = log.read_text()
    assert said.startswith("error: model directory") and "missing-model" in said
    assert said in done.stderr  # the same words as the log line


def test_outside_a_pod_nothing_is_written(tmp_path: Path) -> None:
    log = tmp_path / "no-such-dir" / "termination-log"
    assert _serve(tmp_path, log).returncode == 2
    assert not log.parent.exists()


def test_a_long_message_keeps_its_end(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.write_text("")
    assert record_fatal("x" * 10_000 + " the cause", {"DITSERVE_TERMINATION_LOG": str(log)})
    text = log.read_bytes()
    assert len(text) == MAX_BYTES and text.endswith(b" the cause")
