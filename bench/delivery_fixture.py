"""What ``model_delivery.py`` drives: the model its local hub serves and one node's processes.

The model is a diffusers-shaped repository of random BF16 safetensors (seeded: the same bytes
every run), almost all of it one big transformer file, so a kill or a flipped byte lands in a
file worth resuming. The processes are the real ones a node runs: ``cachectl serve`` (the
daemon) and the pods' ``cachectl pull --daemon-only --link`` (what the operator's init
container runs). Beside them, what the bench reads off a node afterwards: the daemon's pull
phases from its log, the bytes on disk, ``cachectl verify``, and whether all pods got the one
published copy of the served bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from ditserve.cachectl.local_hub import LocalHub, Repo

REPO_ID = "bench/delivery"
URI = f"hf://{REPO_ID}"
BIG = "transformer/diffusion_pytorch_model.safetensors"
VAE = "vae/diffusion_pytorch_model.safetensors"
PODS = 3
COLUMNS = 3072  # BF16 rows of a Flux-like width
WAIT_S = 600.0


# -- the model ------------------------------------------------------------------------------------
def safetensors_bytes(tensors: dict[str, int], rng: random.Random) -> bytes:
    """A safetensors file of BF16 [rows, COLUMNS] tensors (name -> rows) with random data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, rows in tensors.items():
        nbytes = rows * COLUMNS * 2
        header[name] = {"dtype": "BF16", "shape": [rows, COLUMNS],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the format aligns the data to 8 bytes
    # One randbytes call per tensor: a single call is limited to 256 MiB.
    data = [rng.randbytes(rows * COLUMNS * 2) for rows in tensors.values()]
    return b"".join([len(text).to_bytes(8, "little"), text, *data])


def model_files(size_bytes: int, seed: int = 0) -> dict[str, bytes]:
    """A diffusers-shaped repository of about ``size_bytes``: nearly all of it the
    transformer's file (blocks of up to 64 MiB), a small VAE, the configs."""
    rng = random.Random(seed)
    row = COLUMNS * 2
    vae_rows = max(1, min(2**20, size_bytes // 16) // row)
    big_rows = max(1, (size_bytes - vae_rows * row) // row)
    per_block = max(1, (64 << 20) // row)
    blocks = {f"transformer_blocks.{i}.weight": min(per_block, big_rows - start)
              for i, start in enumerate(range(0, big_rows, per_block))}
    index = {"_class_name": "FluxPipeline", "_diffusers_version": "0.32.0",
             "transformer": ["diffusers", "FluxTransformer2DModel"],
             "vae": ["diffusers", "AutoencoderKL"]}
    return {"model_index.json": json.dumps(index).encode(),
            "transformer/config.json": json.dumps({"num_layers": len(blocks)}).encode(),
            BIG: safetensors_bytes(blocks, rng),
            "vae/config.json": b'{"latent_channels": 16}',
            VAE: safetensors_bytes({"decoder.weight": vae_rows}, rng)}


def hub_repo(files: dict[str, bytes]) -> Repo:
    """The files as a local hub repository, hashed once here, not inside a timed resolve."""
    repo = Repo(files)
    for name in files:
        repo.tree_row(name)
    return repo


# -- the processes --------------------------------------------------------------------------------
def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ditserve.cachectl.cli", *args]


def node_env(hub: LocalHub) -> dict[str, str]:
    # The pods' environment (HF_ENDPOINT from the spec) travels to the daemon with the request.
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    return {**env, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url}


class Daemon:
    """``cachectl serve`` on the node's cache root; its log goes to a file."""

    def __init__(self, root: Path, sock: Path, env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "a") as out:
            self.proc = subprocess.Popen(cli("serve", "--root", str(root), "--socket",
                                              str(sock), "--scrub-interval", "0"),
                                         stdout=out, stderr=out, env=env)
        wait_for(lambda: '"daemon_started"' in log.read_text() or self.proc.poll() is not None,
                  "the daemon to start")
        if self.proc.poll() is not None:
            raise RuntimeError(f"the daemon exited {self.proc.returncode}: see {log}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def start_pods(root: Path, sock: Path, env: dict[str, str], work: Path,
               count: int = PODS) -> list[subprocess.Popen[str]]:
    """What the operator's init container runs, once per pod (each with its own link)."""
    return [subprocess.Popen(cli("pull", URI, "--daemon-only", "--root", str(root),
                                  "--socket", str(sock), "--link", str(work / f"pod{i}" / "model"),
                                  "--timeout", str(WAIT_S), "--json"),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for i in range(count)]


def finish_pods(pods: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    results = []
    for p in pods:
        out, err = p.communicate(timeout=WAIT_S)
        result: dict[str, Any] = {"rc": p.returncode, "last_words": " ".join(err.strip().splitlines()[-1:])}
        if p.returncode == 0:
            result |= json.loads(out)
        results.append(result)
    return results


def wait_for(done: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {what}")
        time.sleep(0.01)


def daemon_phases(log: Path) -> dict[str, float]:
    """Seconds the daemon's last pull spent in each phase, from its ``pull_phase`` log lines
    (each phase lasts until the next one is logged; "published" ends the pull)."""
    marks: list[tuple[str, float]] = []
    for line in log.read_text().splitlines():
        if not line.startswith("{"):
            continue
        rec = json.loads(line)
        if rec.get("event") == "pull_phase":
            if rec["phase"] == "resolving":
                marks = []  # a new pull (after a restart): time the last one only
            marks.append((rec["phase"], datetime.fromisoformat(rec["ts"]).timestamp()))
    phases: dict[str, float] = {}
    for (phase, start), (_next, end) in zip(marks, marks[1:], strict=False):
        phases[phase] = phases.get(phase, 0.0) + end - start
    return phases


def settle(folder: Path, quiet_s: float = 1.0) -> None:
    """Wait until the bytes under ``folder`` stop growing for ``quiet_s``."""
    last, since = -1, time.monotonic()
    while time.monotonic() - since < quiet_s:
        now = bytes_on_disk(folder) if folder.exists() else 0
        if now != last:
            last, since = now, time.monotonic()
        time.sleep(0.05)


def verify(root: Path) -> bool:
    """``cachectl verify``: every published file re-hashed against its manifest."""
    return subprocess.run(cli("verify", "--root", str(root)), capture_output=True,
                          timeout=WAIT_S).returncode == 0


def published(root: Path) -> list[str]:
    models = root / "v1" / "models"
    return sorted(p.name for p in models.iterdir()) if models.is_dir() else []


def bytes_on_disk(folder: Path) -> int:
    total = 0
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # renamed into place meanwhile
                total += os.stat(os.path.join(dirpath, name)).st_size
    return total


def same_copy(results: list[dict[str, Any]], files: dict[str, bytes], work: Path) -> bool:
    """Every pod ready on one entry (its answer and its --link), and the entry's big file
    exactly the served one."""
    dirs = {r.get("model_dir") for r in results}
    if len(dirs) != 1 or None in dirs or any(r["rc"] != 0 for r in results):
        return False
    model_dir = Path(str(dirs.pop()))
    links = {(work / f"pod{i}" / "model").resolve() for i in range(len(results))}
    if links != {model_dir.resolve()}:
        return False
    got = hashlib.sha256((model_dir / BIG).read_bytes()).hexdigest()
    return got == hashlib.sha256(files[BIG]).hexdigest()
