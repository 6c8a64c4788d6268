"""Benchmark of the node cache (cachectl) on a multi-GB synthetic entry; prints a table.

Measures: raw SHA-256 speed of this machine (hashlib on an in-memory buffer, 1 thread and
all cores), build (publish) GB/s, verify GB/s with 1 thread and all cores (cold: the entry's
pages dropped with posix_fadvise, and warm), join time of a second process (full re-hash and
stamp-validated), and the PSS of N processes mapping the one entry (from
/proc/PID/smaps_rollup; the target is entry size / N).

Verify hashes fixed-size pieces (manifest schema 2), so even one large shard keeps every core
busy; the line "verify target" compares warm verify with all cores against
0.9 x cores x the single-core SHA-256 rate.

    python3 -P bench/cache.py --size-gib 3 --procs 4
    python3 -P bench/cache.py --size-gib 20 --verify-only     # the verify-throughput target
    python3 -P bench/cache.py --smoke                         # seconds, CPU: for the tests
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ditserve.cachectl.hashing import default_threads
from ditserve.cachectl.identity import identity_for
from ditserve.cachectl.store import CacheStore

GB = 1e9
TARGET_SHARE = 0.9  # of cores x single-core SHA-256, on a warm page cache


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


def random_tensors(n: int, elems: int, threads: int) -> dict[str, np.ndarray]:
    """``n`` float32 tensors of random values, generated in parallel (numpy drops the GIL)."""
    seeds = np.random.SeedSequence(0).spawn(n)

    def one(i: int) -> np.ndarray:
        out = np.empty(elems, dtype=np.float32)
        np.random.default_rng(seeds[i]).random(out=out, dtype=np.float32)
        return out

    with ThreadPoolExecutor(threads) as pool:
        return {f"blocks.{i}.weight": t for i, t in enumerate(pool.map(one, range(n)))}


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


def verify_rates(root: Path, key: str, files: list[Path], size: int, threads: int, *,
                 cold: bool) -> tuple[float | None, float]:
    """(cold GB/s or None, warm GB/s: best of 3 after the page cache is filled)."""
    store = CacheStore(root, create=False, threads=threads)
    cold_rate = None
    if cold:
        drop_pages(files)
        t = time.perf_counter()
        (report,) = store.verify([key])
        cold_rate = size / (time.perf_counter() - t) / GB
        assert report.ok, report.problems
    warm = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        (report,) = store.verify([key])
        warm = min(warm, time.perf_counter() - t)
        assert report.ok, report.problems
    return cold_rate, size / warm / GB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=3.0, help="entry size")
    ap.add_argument("--tensor-mib", type=int, default=64, help="size of each tensor")
    ap.add_argument("--shard-mib", type=int, default=1024, help="shard size")
    ap.add_argument("--procs", type=int, default=4, help="processes mapping the entry at once")
    ap.add_argument("--root", type=Path, default=None, help="cache root (default: a temp dir)")
    ap.add_argument("--verify-only", action="store_true",
                    help="only SHA-256, build and verify (no cold runs, joins or PSS)")
    ap.add_argument("--smoke", action="store_true", help="a tiny verify-only run (tests)")
    args = ap.parse_args()
    if args.smoke:
        args.size_gib, args.tensor_mib, args.shard_mib, args.verify_only = 1 / 16, 4, 16, True
    raw_mib = 32 if args.smoke else 512
    cores = default_threads()
    rows: list[tuple[str, str, str]] = []

    def row(what: str, value: str, note: str = "") -> None:
        rows.append((what, value, note))
        print(f"  {what}: {value} {note}", file=sys.stderr, flush=True)

    single = raw_sha256(1, raw_mib)
    row("raw sha256, 1 thread", f"{single:.2f} GB/s", f"hashlib on a {raw_mib} MiB buffer, best of 3")
    all_cores = raw_sha256(cores, raw_mib)
    row(f"raw sha256, {cores} threads", f"{all_cores:.2f} GB/s",
        f"one buffer per thread, best of 3 ({all_cores / (cores * single):.2f} x cores x 1 thread)")

    with tempfile.TemporaryDirectory(prefix="cachectl-bench-") as tmp:
        root = args.root or Path(tmp) / "cache"
        stages: dict[str, float] = {}
        store = CacheStore(root, shard_bytes=args.shard_mib * 2**20,
                           on_stage=lambda name: stages.setdefault(name, time.perf_counter()))
        n = max(1, int(args.size_gib * 1024 // args.tensor_mib))
        elems = args.tensor_mib * 2**20 // 4
        t = time.perf_counter()
        tensors = random_tensors(n, elems, cores)
        gen_s = time.perf_counter() - t
        size = n * elems * 4
        ident = identity_for(model_digest="b" * 64, dtype="float32", loader="bench",
                             loader_version=str(time.time_ns()))
        start = time.perf_counter()
        entry = store.publish(ident, tensors)
        build_s = time.perf_counter() - start
        entry.close()
        del tensors
        files = [root / "v1" / "entries" / ident.key / f.name for f in entry.manifest.files]
        pieces = sum(len(t.pieces) for t in entry.manifest.tensors)
        row("entry", f"{size / 2**30:.2f} GiB", f"{n} random float32 tensors x {args.tensor_mib} "
            f"MiB ({gen_s:.1f} s to generate), {len(files)} shards, {pieces} pieces of "
            f"{entry.manifest.piece_bytes // 2**20} MiB")
        write_s = stages["written"] - stages["tmp_created"]
        sync_s = stages["synced"] - stages["written"]
        row("build (publish)", f"{size / build_s / GB:.2f} GB/s",
            f"{build_s:.1f} s: write + piece SHA-256 {write_s:.1f} s "
            f"({size / write_s / GB:.2f} GB/s), fsync {sync_s:.1f} s, rest "
            f"{build_s - write_s - sync_s:.2f} s")

        warm_all = 0.0
        for threads in ([cores] if args.verify_only else [1, cores]):
            cold, warm = verify_rates(root, ident.key, files, size, threads,
                                      cold=not args.verify_only)
            warm_all = warm if threads == cores else warm_all
            cold_text = f"{cold:.2f} GB/s cold, " if cold is not None else ""
            row(f"verify, {threads} thread(s)", f"{cold_text}{warm:.2f} GB/s warm",
                "page cache warm: best of 3")
        target = TARGET_SHARE * cores * single
        verdict = "met" if warm_all >= target else "NOT met"
        row("verify target", f"{warm_all:.2f} GB/s warm >= {TARGET_SHARE} x {cores} cores x "
            f"{single:.2f} GB/s = {target:.2f} GB/s: {verdict}",
            f"{warm_all / (cores * single):.2f} x cores x 1 thread; "
            f"{warm_all / all_cores:.2f} x raw hashlib on {cores} threads")
        if not args.verify_only:
            measure_joins_and_sharing(store, ident.key, files, size, args.procs, row)

    print()
    print(f"cachectl bench: {platform.node()} {platform.machine()}, {cores} cores, "
          f"python {platform.python_version()}, numpy {np.__version__}")
    print()
    print("| measurement | result | notes |")
    print("|---|---|---|")
    for what, value, note in rows:
        print(f"| {what} | {value} | {note} |")


def measure_joins_and_sharing(store: CacheStore, key: str, files: list[Path], size: int,
                              procs: int, row: Callable[..., None]) -> None:
    """Join time of a second process (full re-hash, then stamp) and PSS of ``procs`` mappers."""
    # A stamp needs files older than the racy margin; verify once more to record it.
    newest = max(f.stat().st_ctime for f in (*files, files[0].with_name("manifest.json")))
    time.sleep(max(0.0, 2.2 - (time.time() - newest)))
    store.verify([key])
    stamp = store.layout.stamp(key)
    stamp.rename(stamp.with_suffix(".off"))
    for label in ("join, 2nd process, full re-hash", "join, 2nd process, stamp"):
        if "stamp" in label:
            stamp.with_suffix(".off").rename(stamp)
        p = child(store.root, key)
        out = json.loads(p.communicate()[0])
        row(label, f"{out['join_s'] * 1e3:.0f} ms",
            f"validated by {out['validated_by']}; then map all tensors "
            f"{out['map_s'] * 1e3:.0f} ms, read every page {out['touch_s']:.2f} s")
    for mode in ("cow", "readonly"):
        started = [child(store.root, key, mode=mode, hold=True) for _ in range(procs)]
        for p in started:
            assert p.stdout is not None
            json.loads(p.stdout.readline())  # every process has touched every page
        stats = [smaps_rollup(p.pid) for p in started]
        mapped = [entry_pss(p.pid, store.layout.entry(key)) for p in started]
        for p in started:
            p.communicate("")
        pss = sum(s["Pss"] for s in stats) / len(stats)
        anon = sum(s["Anonymous"] for s in stats) / len(stats)
        rss = sum(s["Rss"] for s in stats) / len(stats)
        row(f"PSS of the entry's mappings per process, {procs} procs ({mode})",
            f"{sum(mapped) / len(mapped) / 2**30:.3f} GiB",
            f"target {size / procs / 2**30:.3f} GiB = entry / {procs}")
        row(f"whole-process PSS, {procs} procs ({mode})", f"{pss / 2**30:.2f} GiB",
            f"Rss {rss / 2**30:.2f} GiB, Anonymous {anon / 2**20:.0f} MiB (torch itself)")


if __name__ == "__main__":
    main()
