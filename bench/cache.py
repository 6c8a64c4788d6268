"""Benchmark of the node cache (cachectl) on a multi-GB synthetic entry; prints a table.

Measures: raw SHA-256 speed of this machine (hashlib on an in-memory buffer, 1 thread and
all cores), build (publish) GB/s, verify GB/s with 1 thread and all cores (cold: the entry's
pages dropped with posix_fadvise, and warm), join time of a second process (full re-hash and
stamp-validated), and the PSS of N processes mapping the one entry (from
/proc/PID/smaps_rollup; the target is entry size / N).

    python bench/cache.py --size-gib 3 --procs 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ditserve.cachectl.identity import identity_for
from ditserve.cachectl.store import CacheStore

GB = 1e9


def raw_sha256(threads: int, mib_each: int = 512, repeat: int = 3) -> float:
    """GB/s of hashlib.sha256 over in-memory buffers, one buffer per thread; best of ``repeat``."""
    bufs = [os.urandom(2**20) * mib_each for _ in range(threads)]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeat):
            start = time.perf_counter()
            list(pool.map(lambda b: hashlib.sha256(b).hexdigest(), bufs))
            best = min(best, time.perf_counter() - start)
    return threads * mib_each * 2**20 / best / GB


def drop_pages(paths: list[Path]) -> None:
    """Evict only these files' clean pages from the page cache (no root, nothing else touched)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


CHILD = textwrap.dedent("""
    import json, os, sys, time
    import torch  # imported first: the timings below are the cache's, not torch's start-up
    t0 = time.perf_counter()
    from ditserve.cachectl.store import CacheStore
    root, key, mode, hold = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "hold"
    t1 = time.perf_counter()
    entry = CacheStore(root).join(key)
    t2 = time.perf_counter()
    tensors = entry.readonly_tensors() if mode == "readonly" else entry.tensors()
    t3 = time.perf_counter()
    total = 0.0
    for t in tensors.values():
        total += float(t.float().sum()) if t.numel() < 2**20 else float(t[::1].sum())
    t4 = time.perf_counter()
    print(json.dumps({"import_s": t1 - t0, "join_s": t2 - t1, "map_s": t3 - t2,
                      "touch_s": t4 - t3, "validated_by": entry.validated_by}), flush=True)
    if hold:
        sys.stdin.read()
""")


def child(root: Path, key: str, *, mode: str = "cow", hold: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(root), key, mode,
                             "hold" if hold else "go"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def smaps_rollup(pid: int) -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        out[name] = int(value.split()[0]) * 1024
    return out


def entry_pss(pid: int, entry_dir: Path) -> int:
    """Pss of the mappings of the entry's files only (torch's own memory left out)."""
    total, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping header line
            inside = line.rstrip().endswith(".safetensors") and str(entry_dir) in line
        elif inside and first == "Pss:":
            total += int(line.split()[1]) * 1024
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=3.0, help="entry size")
    ap.add_argument("--tensor-mib", type=int, default=64, help="size of each tensor")
    ap.add_argument("--shard-mib", type=int, default=512, help="shard size")
    ap.add_argument("--procs", type=int, default=4, help="processes mapping the entry at once")
    ap.add_argument("--root", type=Path, default=None, help="cache root (default: a temp dir)")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    rows: list[tuple[str, str, str]] = []

    def row(what: str, value: str, note: str = "") -> None:
        rows.append((what, value, note))
        print(f"  {what}: {value} {note}", file=sys.stderr, flush=True)

    row("raw sha256, 1 thread", f"{raw_sha256(1):.2f} GB/s", "hashlib on a 512 MiB buffer, best of 3")
    row(f"raw sha256, {cores} threads", f"{raw_sha256(cores):.2f} GB/s", "one buffer per thread, best of 3")

    with tempfile.TemporaryDirectory(prefix="cachectl-bench-") as tmp:
        root = args.root or Path(tmp) / "cache"
        stages: dict[str, float] = {}
        store = CacheStore(root, shard_bytes=args.shard_mib * 2**20,
                           on_stage=lambda name: stages.setdefault(name, time.perf_counter()))
        n = int(args.size_gib * 1024 // args.tensor_mib)
        elems = args.tensor_mib * 2**20 // 4
        tensors = {f"blocks.{i}.weight": torch.empty(elems).uniform_() for i in range(n)}
        size = n * elems * 4
        ident = identity_for(model_digest="b" * 64, dtype="float32", loader="bench",
                             loader_version=str(time.time_ns()))
        start = time.perf_counter()
        entry = store.publish(ident, tensors)
        build_s = time.perf_counter() - start
        entry.close()
        del tensors
        files = [root / "v1" / "entries" / ident.key / f.name for f in entry.manifest.files]
        row("entry", f"{size / 2**30:.2f} GiB", f"{n} tensors x {args.tensor_mib} MiB, "
            f"{len(files)} shards")
        write_s = stages["written"] - stages["tmp_created"]
        sync_s = stages["synced"] - stages["written"]
        row("build (publish)", f"{size / build_s / GB:.2f} GB/s",
            f"{build_s:.1f} s: write + file and tensor SHA-256 {write_s:.1f} s "
            f"({size / write_s / GB:.2f} GB/s), fsync {sync_s:.1f} s, rest "
            f"{build_s - write_s - sync_s:.2f} s")

        for threads in (1, cores):
            s = CacheStore(root, threads=threads)
            drop_pages(files)
            t = time.perf_counter()
            (report,) = s.verify([ident.key])
            cold = time.perf_counter() - t
            assert report.ok, report.problems
            warm = float("inf")
            for _ in range(2):  # best of two: the warm figure is the hashing path alone
                t = time.perf_counter()
                s.verify([ident.key])
                warm = min(warm, time.perf_counter() - t)
            row(f"verify, {threads} thread(s)", f"{size / cold / GB:.2f} GB/s cold",
                f"{size / warm / GB:.2f} GB/s warm (page cache)")

        # A stamp needs files older than the racy margin; verify once more to record it.
        newest = max(f.stat().st_ctime for f in (*files, files[0].with_name("manifest.json")))
        time.sleep(max(0.0, 2.2 - (time.time() - newest)))
        store.verify([ident.key])
        store.layout.stamp(ident.key).rename(store.layout.stamp(ident.key).with_suffix(".off"))
        for label in ("join, 2nd process, full re-hash", "join, 2nd process, stamp"):
            if "stamp" in label:
                store.layout.stamp(ident.key).with_suffix(".off").rename(store.layout.stamp(ident.key))
            p = child(root, ident.key)
            out = json.loads(p.communicate()[0])
            row(label, f"{out['join_s'] * 1e3:.0f} ms",
                f"validated by {out['validated_by']}; then map all tensors "
                f"{out['map_s'] * 1e3:.0f} ms, read every page {out['touch_s']:.2f} s")

        for mode in ("cow", "readonly"):
            procs = [child(root, ident.key, mode=mode, hold=True) for _ in range(args.procs)]
            for p in procs:
                assert p.stdout is not None
                json.loads(p.stdout.readline())  # every process has touched every page
            stats = [smaps_rollup(p.pid) for p in procs]
            mapped = [entry_pss(p.pid, store.layout.entry(ident.key)) for p in procs]
            for p in procs:
                p.communicate("")
            pss = sum(s["Pss"] for s in stats) / len(stats)
            anon = sum(s["Anonymous"] for s in stats) / len(stats)
            rss = sum(s["Rss"] for s in stats) / len(stats)
            target = size / args.procs
            row(f"PSS of the entry's mappings per process, {args.procs} procs ({mode})",
                f"{sum(mapped) / len(mapped) / 2**30:.3f} GiB",
                f"target {target / 2**30:.3f} GiB = entry / {args.procs}")
            row(f"whole-process PSS, {args.procs} procs ({mode})", f"{pss / 2**30:.2f} GiB",
                f"Rss {rss / 2**30:.2f} GiB, Anonymous {anon / 2**20:.0f} MiB (torch itself)")

    print()
    print(f"cachectl bench: {platform.node()} {platform.machine()}, {cores} cores, "
          f"python {platform.python_version()}, torch {torch.__version__}")
    print()
    print("| measurement | result | notes |")
    print("|---|---|---|")
    for what, value, note in rows:
        print(f"| {what} | {value} | {note} |")


if __name__ == "__main__":
    main()
