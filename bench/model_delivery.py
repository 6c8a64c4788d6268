"""Issue 50's delivery target, measured: a ~1 GiB hf:// model from the local hub lands in one
node's cache once for three pods, resumes after its daemon is SIGKILLed mid-download, and a
corrupted byte is refused.

    python bench/model_delivery.py --size-mib 1024 [--workdir DIR] [--json PATH]

The model is a diffusers-shaped repository (model_index.json, configs, a VAE and one large
transformer safetensors file of random BF16 tensors) served by ``ditserve.cachectl.local_hub``
from memory, which counts the bytes it sends per file and per GET. Every scenario uses a fresh
cache root and real processes: ``cachectl serve`` (the node daemon) and three "pods" running
what the operator's ``cachectl-pull`` init container runs (``cachectl pull URI --daemon-only
--link ...``), at once.

    once     three pods, one daemon: bytes served against the model's size, seconds from the
             pods' start to the last one ready, one entry for all, ``cachectl verify`` passes
    resume   the hub holds the big file at --kill-at of its bytes; the daemon is SIGKILLed
             there and started again; the bytes served after the restart against what was
             missing on disk at the kill, where the new GET started, ``verify`` passes
    flipped  the big file served once with a byte flipped: caught, fetched again, published
    corrupt  the big file served with a byte flipped every time: the pull fails with the
             digest error, nothing is published

Prints a markdown table (and writes --json). Timings are this machine's; the outcomes are
what ``tests/test_bench_model_delivery.py`` checks at a small size.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
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


# -- the processes --------------------------------------------------------------------------------
def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ditserve.cachectl.cli", *args]


def _env(hub: LocalHub) -> dict[str, str]:
    # The pods' environment (HF_ENDPOINT from the spec) travels to the daemon with the request.
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    return {**env, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url}


class Daemon:
    """``cachectl serve`` on the node's cache root; its log goes to a file."""

    def __init__(self, root: Path, sock: Path, env: dict[str, str], log: Path) -> None:
        self.log = log
        with open(log, "a") as out:
            self.proc = subprocess.Popen(_cli("serve", "--root", str(root), "--socket",
                                              str(sock), "--scrub-interval", "0"),
                                         stdout=out, stderr=out, env=env)
        _wait_for(lambda: '"daemon_started"' in log.read_text() or self.proc.poll() is not None,
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
    return [subprocess.Popen(_cli("pull", URI, "--daemon-only", "--root", str(root),
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


def _wait_for(done: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
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


def _settle(folder: Path, quiet_s: float = 1.0) -> None:
    """Wait until the bytes under ``folder`` stop growing for ``quiet_s``."""
    last, since = -1, time.monotonic()
    while time.monotonic() - since < quiet_s:
        now = _bytes_on_disk(folder) if folder.exists() else 0
        if now != last:
            last, since = now, time.monotonic()
        time.sleep(0.05)


def verify(root: Path) -> bool:
    """``cachectl verify``: every published file re-hashed against its manifest."""
    return subprocess.run(_cli("verify", "--root", str(root)), capture_output=True,
                          timeout=WAIT_S).returncode == 0


def published(root: Path) -> list[str]:
    models = root / "v1" / "models"
    return sorted(p.name for p in models.iterdir()) if models.is_dir() else []


def _bytes_on_disk(folder: Path) -> int:
    total = 0
    for dirpath, _dirs, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # renamed into place meanwhile
                total += os.stat(os.path.join(dirpath, name)).st_size
    return total


def _same_copy(results: list[dict[str, Any]], files: dict[str, bytes], work: Path) -> bool:
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


# -- the scenarios --------------------------------------------------------------------------------
class Bench:
    def __init__(self, hub: LocalHub, files: dict[str, bytes], work: Path) -> None:
        self.hub, self.files, self.work = hub, files, work
        self.model_bytes = sum(len(d) for d in files.values())
        self.env = _env(hub)

    def _node(self, name: str) -> tuple[Path, Path, Path]:
        node = self.work / name
        node.mkdir(parents=True)
        return node / "cache", node / "run" / "cachectl.sock", node

    def _served_since(self, first_get: int) -> int:
        return sum(g.sent for g in self.hub.gets[first_get:])

    def once(self) -> dict[str, Any]:
        root, sock, node = self._node("once")
        daemon = Daemon(root, sock, self.env, node / "daemon.log")
        try:
            first = len(self.hub.gets)
            start = time.monotonic()
            results = finish_pods(start_pods(root, sock, self.env, node))
            seconds = time.monotonic() - start
        finally:
            daemon.stop()
        served = self._served_since(first)
        return {"scenario": "once", "served": served, "seconds": seconds,
                "daemon_phases": daemon_phases(node / "daemon.log"),
                "one_entry": _same_copy(results, self.files, node) and len(published(root)) == 1,
                "verified": verify(root), "pods": results}

    def resume(self, kill_at: float) -> dict[str, Any]:
        root, sock, node = self._node("resume")
        hold = int(len(self.files[BIG]) * kill_at)
        self.hub.hold(BIG, hold)
        first = len(self.hub.gets)
        start = time.monotonic()
        daemon = Daemon(root, sock, self.env, node / "daemon.log")
        pods = start_pods(root, sock, self.env, node)
        try:
            _wait_for(lambda: self.hub.held(BIG), "the download to reach the hold point")
            # The daemon writes what it received in huggingface_hub's 10 MiB chunks; let it
            # write what is in flight, so the kill loses no more than a real one would.
            _settle(root / ".partial")
            daemon.kill()  # mid-download, as a node's OOM killer or a crash would
            on_disk = _bytes_on_disk(root / ".partial")
            served_before = self._served_since(first)
            restart_from = len(self.hub.gets)
            self.hub.release()  # the held GET's client is dead: it ends with a broken pipe
            daemon = Daemon(root, sock, self.env, node / "daemon.log")
            results = finish_pods(pods)
            seconds = time.monotonic() - start
        finally:
            self.hub.release()
            daemon.stop()
        after = self.hub.gets[restart_from:]
        big_starts = [g.start for g in after if g.name == BIG]
        return {"scenario": "resume", "served": self._served_since(first),
                "seconds": seconds, "killed_at_served": served_before,
                "on_disk_at_kill": on_disk,
                "daemon_phases": daemon_phases(node / "daemon.log"),  # the restarted one
                "missing_at_kill": self.model_bytes - on_disk,
                "served_after_restart": self._served_since(restart_from),
                "big_get_starts_after_restart": big_starts,
                "one_entry": _same_copy(results, self.files, node) and len(published(root)) == 1,
                "verified": verify(root), "pods": results}

    def corrupted(self, times: int) -> dict[str, Any]:
        name = "flipped" if times == 1 else "corrupt"
        root, sock, node = self._node(name)
        daemon = Daemon(root, sock, self.env, node / "daemon.log")
        self.hub.corrupt[BIG] = times
        try:
            first = len(self.hub.gets)
            start = time.monotonic()
            results = finish_pods(start_pods(root, sock, self.env, node, count=1))
            seconds = time.monotonic() - start
        finally:
            self.hub.corrupt.pop(BIG, None)
            daemon.stop()
        return {"scenario": name, "served": self._served_since(first), "seconds": seconds,
                "rc": results[0]["rc"], "error": results[0]["last_words"],
                "published": published(root),
                "one_entry": _same_copy(results, self.files, node),
                "verified": verify(root) if published(root) else None, "pods": results}


# -- judging and the table ------------------------------------------------------------------------
def judge(row: dict[str, Any], model_bytes: int) -> tuple[bool, str]:
    """Whether a scenario met its target, and what it showed, in a few words."""
    s = row["scenario"]
    if s == "once":
        ok = row["served"] == model_bytes and row["one_entry"] and row["verified"]
        return ok, f"{PODS} pods, one entry, verified" if ok else "NOT once: see the JSON"
    if s == "resume":
        starts = row["big_get_starts_after_restart"]
        resumed = bool(starts) and starts[0] > 0
        # The restarted daemon fetches what was missing on disk, never the whole again.
        ok = resumed and row["served_after_restart"] <= row["missing_at_kill"] \
            and row["one_entry"] and row["verified"]
        what = (f"killed at {row['on_disk_at_kill'] / 2**20:.1f} MiB on disk; GET resumed at "
                f"byte {starts[0] if starts else '-'}; re-downloaded "
                f"{row['served_after_restart'] / 2**20:.1f} MiB of "
                f"{row['missing_at_kill'] / 2**20:.1f} MiB missing; verified" if ok else "")
        return ok, what or f"NOT resumed: GET starts {starts}, see the JSON"
    if s == "flipped":
        ok = row["rc"] == 0 and row["one_entry"] and bool(row["verified"])
        return ok, "flip caught, file fetched again, verified" if ok else "NOT healed"
    ok = row["rc"] != 0 and "digest" in row["error"] and row["published"] == []
    return ok, (f"refused, nothing published: {row['error']}" if ok
                else f"NOT refused (rc {row['rc']}, published {row['published']})")


def table(rows: list[dict[str, Any]], model_bytes: int) -> str:
    lines = ["| scenario | model MiB | served MiB | served / model | seconds | served MiB/s "
             "| ok | outcome |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ok, what = judge(row, model_bytes)
        lines.append(f"| {row['scenario']} | {model_bytes / 2**20:.1f} | "
                     f"{row['served'] / 2**20:.1f} | {row['served'] / model_bytes:.3f}x | "
                     f"{row['seconds']:.1f} | {row['served'] / 2**20 / row['seconds']:.0f} | "
                     f"{'yes' if ok else 'NO'} | {what} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mib", type=float, default=1024.0, help="the model's size")
    ap.add_argument("--kill-at", type=float, default=0.4,
                    help="share of the big file served when the daemon is killed")
    ap.add_argument("--scenarios", nargs="+", default=["once", "resume", "flipped", "corrupt"],
                    choices=["once", "resume", "flipped", "corrupt"])
    ap.add_argument("--workdir", type=Path, default=None,
                    help="where the node caches go (default: a temporary folder, removed)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = ap.parse_args(argv)
    files = model_files(int(args.size_mib * 2**20))
    model_bytes = sum(len(d) for d in files.values())
    repo = Repo(files)
    for name in files:  # the hub hashes its files once, here, not inside a timed resolve
        repo.tree_row(name)
    with tempfile.TemporaryDirectory(prefix="model-delivery-") as tmp, \
            LocalHub(repos={REPO_ID: repo}).running() as hub:
        work = args.workdir or Path(tmp)
        bench = Bench(hub, files, work)
        runs = {"once": bench.once, "resume": lambda: bench.resume(args.kill_at),
                "flipped": lambda: bench.corrupted(1), "corrupt": lambda: bench.corrupted(2)}
        rows = [runs[name]() for name in args.scenarios]
    print(f"{URI}: {model_bytes} bytes ({model_bytes / 2**20:.1f} MiB) in {len(files)} files; "
          f"{PODS} pods per node, one `cachectl serve`")
    print(table(rows, model_bytes))
    for row in rows:
        if row.get("daemon_phases"):
            which = "restarted daemon's" if row["scenario"] == "resume" else "daemon's"
            print(f"{row['scenario']}: the {which} pull by phase (s): " + ", ".join(
                f"{phase} {sec:.1f}" for phase, sec in row["daemon_phases"].items()))
    verdicts = [judge(r, model_bytes)[0] for r in rows]
    if args.json is not None:
        args.json.write_text(json.dumps({"model_bytes": model_bytes, "rows": rows,
                                         "files": {n: len(d) for n, d in files.items()},
                                         "ok": verdicts}, indent=1, default=str))
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
