#!/usr/bin/env python3
"""DLO host backings on one GPU: private pinned slabs vs runtime-cache mmap (staging, registered).

One process, one random Flux-structured transformer (the Flux family's DiT,
default widths with guidance embeds, bf16, made on the GPU from a fixed seed); by default
6 double + 12 single blocks (a third of Flux, so the node cache entry is written within the
device time; ``--double/--single 19 38`` is full Flux). Batch 1 at 1024x1024 (4096 image +
512 text tokens). Methods, every block streamed:

- ``private``: ``enable_offload`` without a plan: private ``cudaHostRegister``ed slabs;
- ``mmap-staging``: the DiT bound to a published node cache entry (runtime-cache backing),
  ``pin_limit_gib=0``: two pinned staging slots;
- ``mmap-registered``: the same with a pin limit covering the entry: the read-only mapping
  is registered (``cudaHostRegisterReadOnly``), loads DMA straight from the page cache.

Reports ms/step (median of CUDA-event timings), ms per streamed block, enable time, the
process's Rss/Pss/anonymous memory (``/proc/self/smaps_rollup``) while each method is
enabled, whether its output equals the resident model's, and the total Pss of 2 and 4
processes mapping the same entry. Also probes ``cudaHostRegister`` on a writable
(safetensors copy-on-write) mapping vs a read-only one. Writes JSON to --out.

    python3 bench/offload_mmap.py --out $OUT
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
import torch

from ditserve.engine.config import OffloadConfig
from ditserve.engine.makers.builders import dit_class
from ditserve.engine.offload import enable_offload
from ditserve.engine.offload.host.weight_plan import BackingKind, HostWeightPlan  # noqa: E402
from ditserve.engine.weights.checkpoint_mmap import MappedSafetensors, map_dit  # noqa: E402
from ditserve.engine.weights.runtime_cache import release_private_memory  # noqa: E402

GIB = 1024**3
PAGE = 4096


log = harness.log


def smaps() -> dict[str, float]:
    """This process's memory, GiB: Rss, Pss, Pss_Anon, Pss_File, Anonymous."""
    out: dict[str, float] = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024 / GIB
    keys = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Anonymous")
    return {k: round(out.get(k, float("nan")), 3) for k in keys}


def file_pss(paths: list[str]) -> dict[str, float]:
    """Rss and Pss (GiB) of this process's mappings of ``paths`` (from /proc/self/smaps)."""
    wanted, current = set(paths), False
    rss = pss = 0
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
                current = len(parts) >= 6 and parts[5] in wanted
            elif current and parts[0] == "Rss:":
                rss += int(parts[1])
            elif current and parts[0] == "Pss:":
                pss += int(parts[1])
    return {"entry_rss": round(rss * 1024 / GIB, 3), "entry_pss": round(pss * 1024 / GIB, 3)}


def _share_child(paths: list[str], barrier: Any, queue: Any) -> None:
    """Map the entry read-only, touch every page, report memory while all peers map it."""
    files = [MappedSafetensors(Path(p)) for p in paths]
    touched = sum(int(f.raw[::PAGE].sum()) for f in files)  # one byte per page: all mapped
    barrier.wait()
    queue.put({**smaps(), **file_pss(paths), "touched": touched})
    barrier.wait()


def shared_pss(paths: list[str], procs: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_share_child, args=(paths, barrier, queue)) for _ in range(procs)]
    for w in workers:
        w.start()
    stats = [queue.get(timeout=300) for _ in range(procs)]
    for w in workers:
        w.join(timeout=60)
    return {
        "procs": procs,
        "total_entry_pss_gib": round(sum(s["entry_pss"] for s in stats), 3),
        "total_entry_rss_gib": round(sum(s["entry_rss"] for s in stats), 3),
        "total_pss_gib": round(sum(s["Pss"] for s in stats), 3),
        "per_process": stats,
    }


def register_probe(path: Path, key: str) -> dict[str, str]:
    """cudaHostRegister(ReadOnly) on a writable copy-on-write (safetensors) vs read-only map."""
    if not torch.cuda.is_available():
        return {}
    from safetensors import safe_open

    cudart = torch.cuda.cudart()
    out = {}
    handle = safe_open(str(path), framework="pt")
    mapped = MappedSafetensors(path)
    for name, tensor in (("safetensors (MAP_PRIVATE, writable)", handle.get_tensor(key)),
                         ("read-only MAP_SHARED", mapped.view(key))):
        start = -(-tensor.data_ptr() // PAGE) * PAGE
        nbytes = (tensor.data_ptr() + tensor.numel() * tensor.element_size() - start) // PAGE * PAGE
        err = cudart.cudaHostRegister(start, nbytes, 8)
        out[name] = cudart.cudaGetErrorString(err)
        if err == cudart.cudaError.success:
            cudart.cudaHostUnregister(start)
    del handle
    mapped.close()
    return out


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if torch.cuda.is_available() else torch.device("cpu"))
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "gpu": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "torch": torch.__version__, "methods": {},
        }
        self.paths: list[str] = []

    def save(self) -> None:
        (self.out / "offload_mmap_bench.json").write_text(json.dumps(self.results, indent=1))

    def time_method(self, name: str, model: torch.nn.Module, config: OffloadConfig,
                    plan: HostWeightPlan | None, inputs: dict[str, Any],
                    expected: torch.Tensor) -> None:
        gc.collect()
        before = smaps()
        log(f"{name}: enabling")
        started = time.perf_counter()
        handle = enable_offload(model, config, self.device, host_plan=plan)
        enable_s = time.perf_counter() - started
        try:
            times = harness.time_steps(model, inputs, self.args.warmup, self.args.iters).ms
            with torch.no_grad():
                equal = bool(torch.equal(model(**inputs)[0], expected))
            report = handle.snapshot().to_json()
            during = {**smaps(), **file_pss(self.paths)}
        finally:
            handle.disable()
        previous = self.results["methods"].get(name, {}).get("ms_all", [])
        rounds = self.results["methods"].get(name, {}).get("rounds", 0) + 1
        times = previous + list(times)  # later rounds add to the same median
        ms = statistics.median(times)
        self.results["methods"][name] = {
            "rounds": rounds,
            "ms": round(ms, 2), "ms_all": [round(t, 2) for t in times],
            "ms_per_block": round(ms / max(report["streamed_blocks"], 1), 3),
            "enable_s": round(enable_s, 2), "equal_to_resident": equal,
            "smaps_before": before, "smaps_during": during,
            "report": {k: report.get(k) for k in (
                "backing", "backing_kind", "transfer_path", "fallback_reason", "streamed_blocks",
                "streamed_bytes", "host_bytes", "pinned_host_bytes", "registered_bytes",
                "registered_ranges", "slot_bytes", "mapped_copies_per_pass",
                "mapped_tensors_per_pass")},
        }
        log(f"{name:16s} {ms:8.1f} ms/step ({ms / max(report['streamed_blocks'], 1):.2f} "
            f"ms/block), enable {enable_s:.1f}s, equal={equal}, Rss {during['Rss']:.2f} "
            f"Pss {during['Pss']:.2f} anon {during['Anonymous']:.2f} entry-Pss "
            f"{during['entry_pss']:.2f} GiB, "
            f"pinned {report['pinned_host_bytes'] / GIB:.2f} GiB via {report['backing']}")
        self.save()

    def mapped_model(self, store: Any, key: str, config: dict[str, Any]) -> tuple[Any, HostWeightPlan]:

        entry = store.join(key)
        files = [MappedSafetensors(p) for p in entry.files() if p.suffix == ".safetensors"]
        model, checked, views = map_dit(dit_class("flux"), config, torch.bfloat16, files)
        if model is None:
            raise SystemExit(f"entry does not fit the model: {checked.reason}")
        plan = HostWeightPlan(BackingKind.RUNTIME_CACHE, reason="bench: entry mapped",
                              bindings=checked.bindings, sources=views, mappings=files,
                              coverage=checked.coverage, skipped_materialization=True,
                              lease=entry)
        return model, plan

    def run(self) -> None:
        from ditserve.cachectl.identity import EntryIdentity
        from ditserve.cachectl.store import CacheStore

        a = self.args
        log(f"GPU {self.results['gpu']}, torch {torch.__version__}")
        # --tiny keeps the tiny config's own block counts (a CPU smoke run).
        blocks = {} if a.tiny else {"num_layers": a.double, "num_single_layers": a.single}
        model = harness.build_flux(self.device, tiny=a.tiny, **blocks)
        config: dict[str, Any] = dict(model.config)  # type: ignore[arg-type]
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        self.results["model"] = {"double": a.double, "single": a.single, "bytes": weights}
        inputs = harness.flux_inputs(model, a.res, 1, self.device)
        with torch.no_grad():
            expected = model(**inputs)[0].clone()
        resident = harness.time_steps(model, inputs, a.warmup, a.iters).ms
        self.results["methods"]["resident"] = {"ms": round(statistics.median(resident), 2)}
        log(f"model {weights / GIB:.2f} GiB; resident {statistics.median(resident):.1f} ms/step")

        root = Path(a.cache_root or tempfile.mkdtemp(prefix="ditserve-bench-cache-"))
        store = CacheStore(root, threads=os.cpu_count())
        digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
        identity = EntryIdentity(revision=f"bench-seed0-{a.double}x{a.single}", dtype="bfloat16",
                                 loader="bench/offload_mmap.py", loader_version="1",
                                 model_digest=digest)
        started = time.perf_counter()
        entry = store.publish(identity, model.state_dict())  # GPU tensors, copied one by one
        self.results["entry"] = {"key": entry.key, "bytes": entry.total_bytes,
                                 "files": len(entry.files()),
                                 "publish_s": round(time.perf_counter() - started, 1)}
        paths = [str(p) for p in entry.files() if p.suffix == ".safetensors"]
        self.paths = paths
        biggest = max(entry.manifest.tensors, key=lambda t: t.nbytes)
        entry.close()
        log(f"entry {entry.key[:12]}: {self.results['entry']}")

        # Rounds alternate the methods, so drift on the machine (other tenants, clocks) shows
        # up in every method's times instead of in the ratio.
        for _ in range(a.rounds):
            if "private" in a.methods:
                self.time_method("private", model, OffloadConfig(enabled=True), None, inputs,
                                 expected)
            release_private_memory()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            for name, pin in (("mmap-staging", 0.0), ("mmap-registered", 4 * weights / GIB)):
                if name not in a.methods:
                    continue
                mapped, plan = self.mapped_model(store, entry.key, config)
                self.time_method(name, mapped, OffloadConfig(enabled=True, pin_limit_gib=pin),
                                 plan, inputs, expected)
                del mapped, plan
                release_private_memory()
        del model
        release_private_memory()

        for procs in a.procs:
            self.results.setdefault("sharing", []).append(shared_pss(paths, procs))
            s = self.results["sharing"][-1]
            log(f"{procs} processes mapping the entry: entry Pss summed {s['total_entry_pss_gib']:.2f} "
                f"GiB, entry Rss summed {s['total_entry_rss_gib']:.2f} GiB, whole-process Pss "
                f"summed {s['total_pss_gib']:.2f} GiB (entry {entry.total_bytes / GIB:.2f} GiB)")
            self.save()
        if a.probe:  # last: a refused registration of a writable mapping may be slow
            log("probing cudaHostRegister(ReadOnly) on writable vs read-only mappings")
            self.results["register_probe"] = register_probe(
                entry.path / biggest.file, biggest.name)
            log(f"cudaHostRegister(ReadOnly): {self.results['register_probe']}")
        private = self.results["methods"].get("private", {}).get("ms")
        registered = self.results["methods"].get("mmap-registered", {}).get("ms")
        if private and registered:
            self.results["registered_over_private"] = round(registered / private, 3)
            log(f"registered / private = {registered / private:.3f} (target <= 1.05)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out/offload_mmap"))
    p.add_argument("--double", type=int, default=6, help="double-stream blocks (Flux: 19)")
    p.add_argument("--single", type=int, default=12, help="single-stream blocks (Flux: 38)")
    p.add_argument("--res", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--procs", type=int, nargs="*", default=[2, 4])
    p.add_argument("--rounds", type=int, default=1,
                   help="run the methods this many times, alternating (medians over all)")
    p.add_argument("--cache-root", default=None, help="default: a fresh temporary directory")
    p.add_argument("--methods", nargs="+", default=["private", "mmap-staging", "mmap-registered"])
    p.add_argument("--probe", action="store_true",
                   help="also try cudaHostRegister on a writable (safetensors) mapping")
    p.add_argument("--tiny", action="store_true", help="small model: smoke-test on a CPU")
    args = p.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("bench/offload_mmap.py needs a CUDA device (or --tiny)", file=sys.stderr)
        return 2
    bench = Bench(args)
    try:
        bench.run()
    finally:
        bench.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
