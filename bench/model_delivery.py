"""Issue 50's delivery target, measured: a ~1 GiB hf:// model from the local hub lands in one
node's cache once for three pods, resumes after its daemon is SIGKILLed mid-download, and a
corrupted byte is refused.

    python bench/model_delivery.py --size-mib 1024 [--workdir DIR] [--json PATH]

The model is a diffusers-shaped repository (model_index.json, configs, a VAE and one large
transformer safetensors file of random BF16 tensors) served by ``ditserve.cachectl.local_hub``
from memory, which counts the bytes it sends per file and per GET. Every scenario uses a fresh
cache root and real processes: ``cachectl serve`` (the node daemon) and three "pods" running
what the operator's ``cachectl-pull`` init container runs (``cachectl pull URI --daemon-only
--link ...``), at once. The model and these processes are ``delivery_fixture.py``'s.

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
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from delivery_fixture import (
    BIG,
    PODS,
    REPO_ID,
    URI,
    Daemon,
    bytes_on_disk,
    daemon_phases,
    finish_pods,
    hub_repo,
    model_files,
    node_env,
    published,
    same_copy,
    settle,
    start_pods,
    verify,
    wait_for,
)

from ditserve.cachectl.local_hub import LocalHub


# -- the scenarios --------------------------------------------------------------------------------
class Bench:
    def __init__(self, hub: LocalHub, files: dict[str, bytes], work: Path) -> None:
        self.hub, self.files, self.work = hub, files, work
        self.model_bytes = sum(len(d) for d in files.values())
        self.env = node_env(hub)

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
                "one_entry": same_copy(results, self.files, node) and len(published(root)) == 1,
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
            wait_for(lambda: self.hub.held(BIG), "the download to reach the hold point")
            # The daemon writes what it received in huggingface_hub's 10 MiB chunks; let it
            # write what is in flight, so the kill loses no more than a real one would.
            settle(root / ".partial")
            daemon.kill()  # mid-download, as a node's OOM killer or a crash would
            on_disk = bytes_on_disk(root / ".partial")
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
                "one_entry": same_copy(results, self.files, node) and len(published(root)) == 1,
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
                "one_entry": same_copy(results, self.files, node),
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
    repo = hub_repo(files)
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
