"""The benchmark programs' shared pieces: model, inputs, step timer, link probes, results.

Every program in bench/ that builds a Flux-sized transformer, times steps or writes a result
table takes them from here, so two programs never disagree on a model or a timer: the random
Flux builder (``build_flux``: diffusers' default config with guidance embeds, bf16, made on
the device; ``tiny=True`` for CPU smoke runs), its inputs (``flux_inputs``, shaped from the
model's own config), the CUDA-event step timer (``time_steps``), host->device copy rates
(``copy_gbps``, ``measure_h2d``), the torch-profiler pass (``profile_steps``), memory facts
(``rss_gib``, ``guest_physical_gib``), the writers (``write_json``, ``md_table``) and what the
serving benchmarks share: Poisson arrivals, percentiles, ``/metrics`` samples and the step
counters read from their deltas (``poisson_arrivals``, ``percentile``, ``scrape_metrics``,
``step_summary``; a free port is ``job_processes.free_port``).

Programs read engine state only through the offload handle's public, typed report
(``handle.snapshot()``) and read-only probe (``handle.probe()``): no private attributes, no
patched engine functions, no module-level settings changed at run time. They import this
module as ``harness`` (a program's own folder is first on ``sys.path`` when it runs as
``python3 bench/<name>.py``) and never import one another.
"""

from __future__ import annotations

import gc
import gzip
import json
import math
import platform
import random
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ditserve.engine.makers.builders import dit_class
from ditserve.engine.offload.host.memory import host_memory

GIB = 1024**3
TEXT_TOKENS = 512
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
# A small config with Flux's structure, to smoke-test a program on a CPU.
TINY: dict[str, Any] = dict(
    num_layers=3, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=64, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def environment(device: torch.device) -> dict[str, str]:
    """Date, device, torch and Python versions: the header of every result file."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


# -- the model and its inputs -----------------------------------------------------------------
def build_flux(device: torch.device, *, seed: int = 0, tiny: bool = False,
               dtype: torch.dtype = torch.bfloat16, **config: Any) -> torch.nn.Module:
    """The default Flux transformer (11.9B parameters), random weights (bf16 unless
    ``dtype``) made on ``device`` (no CPU init); ``tiny`` starts from ``TINY``; ``config``
    overrides either (e.g. fewer blocks)."""

    with torch.device("meta"):
        model: Any = dit_class("flux")(
            guidance_embeds=True, **{**(TINY if tiny else {}), **config})
    model = model.to(dtype).to_empty(device=device).eval()
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
        for b in model.buffers():
            b.zero_()
    return model  # type: ignore[no-any-return]


def build_image_dit(variant: str, device: torch.device, *, seed: int = 0, tiny: bool = False,
                    dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A random image DiT of ``variant`` (``engine.makers.builders``: "flux" is
    ``build_flux``; "flux2", "flux2-klein", "flux2-klein-9b": FLUX.2's DiT at the released
    shapes, or tiny), made on ``device`` as ``build_flux`` makes Flux's."""
    if variant == "flux":
        return build_flux(device, seed=seed, tiny=tiny, dtype=dtype)
    from ditserve.engine.makers.builders import make_dit

    return make_dit(variant, "tiny" if tiny else "full", dtype=dtype, device=device,  # type: ignore[no-any-return]
                    seed=seed)


def image_inputs(variant: str, model: torch.nn.Module, res: int, batch: int,
                 device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """One denoise step's inputs of ``variant``'s DiT at ``res`` x ``res``: Flux's
    (``flux_inputs``) or FLUX.2's (4-axis position ids, no pooled text, guidance only when
    the DiT embeds it; ``TEXT_TOKENS`` text, the pipeline's padded prompt)."""
    if variant == "flux":
        return flux_inputs(model, res, batch, device, dtype)
    side = res // 16  # VAE /8, then one token per 2x2 latents
    g = torch.Generator(device=device).manual_seed(1)
    cfg: Any = model.config

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    def ids(*axes: int) -> torch.Tensor:
        return torch.cartesian_prod(*(torch.arange(n, device=device) for n in axes))

    return dict(
        hidden_states=randn(batch, side * side, cfg.in_channels),
        encoder_hidden_states=randn(batch, TEXT_TOKENS, cfg.joint_attention_dim),
        timestep=torch.full((batch,), 0.5, device=device, dtype=dtype),
        guidance=(torch.full((batch,), 4.0, device=device, dtype=dtype)
                  if cfg.guidance_embeds else None),
        img_ids=ids(1, side, side, 1), txt_ids=ids(1, 1, 1, TEXT_TOKENS), return_dict=False,
    )


def flux_inputs(model: torch.nn.Module, res: int, batch: int,
                device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """One denoise step's inputs for ``model`` at ``res`` x ``res`` (``TEXT_TOKENS`` text)."""
    side = res // 16  # VAE /8, then 2x2 patch packing
    g = torch.Generator(device=device).manual_seed(1)
    dt = dtype
    cfg: Any = model.config

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dt)

    img_ids = torch.zeros(side, side, 3, device=device)
    img_ids[..., 1] = torch.arange(side, device=device)[:, None]
    img_ids[..., 2] = torch.arange(side, device=device)[None, :]
    return dict(
        hidden_states=randn(batch, side * side, cfg.in_channels),
        encoder_hidden_states=randn(batch, TEXT_TOKENS, cfg.joint_attention_dim),
        pooled_projections=randn(batch, cfg.pooled_projection_dim),
        timestep=torch.full((batch,), 0.5, device=device, dtype=dt),
        guidance=torch.full((batch,), 3.5, device=device, dtype=dt),
        img_ids=img_ids.reshape(-1, 3),
        txt_ids=torch.zeros(TEXT_TOKENS, 3, device=device),
        return_dict=False,
    )


# -- timing -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTimes:
    """Per-step ms (CUDA events; wall clock on a CPU) and the host time to queue each step
    (is the host ahead of the GPU?)."""

    ms: list[float]
    host_queue_ms: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ms)


def time_steps(model: Callable[..., Any], inputs: dict[str, Any], warmup: int,
               iters: int) -> StepTimes:
    """Steps queued back to back like a denoise loop, each bracketed by CUDA events."""
    if not torch.cuda.is_available():  # a smoke run on a CPU: wall clock
        with torch.no_grad():
            for _ in range(warmup):
                model(**inputs)
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                model(**inputs)
                times.append((time.perf_counter() - t0) * 1e3)
        return StepTimes(times, [])
    with torch.no_grad():
        for _ in range(warmup):
            model(**inputs)
        sync()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        host = []
        for s, e in zip(starts, ends, strict=True):
            t0 = time.perf_counter()
            s.record()
            model(**inputs)
            e.record()
            host.append((time.perf_counter() - t0) * 1e3)
        sync()
    return StepTimes([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)], host)


def blocks_compiled(model: torch.nn.Module) -> bool:
    """Whether ``compile_repeated_blocks`` compiled ``model``'s blocks (it sets each block's
    ``forward`` as an instance attribute)."""
    return any("forward" in vars(m) for m in model.modules())


def uncompile_blocks(model: torch.nn.Module) -> None:
    """Undo ``compile_repeated_blocks``: the blocks' class ``forward`` again, and dynamo's
    caches dropped (the next compile starts from scratch, for the model as it is then)."""
    for module in model.modules():
        vars(module).pop("forward", None)
    torch.compiler.reset()


# -- host -> device links -------------------------------------------------------------------------
def copy_gbps(dev: torch.Tensor, host: torch.Tensor, stream: Any, reps: int) -> float:
    """GB/s of ``dev.copy_(host)`` on ``stream`` (median of ``reps`` CUDA-event timings)."""
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            s.record(stream)
            dev.copy_(host, non_blocking=True)
            e.record(stream)
        e.synchronize()
        times.append(s.elapsed_time(e))
    return host.numel() * host.element_size() / (statistics.median(times) * 1e-3) / 1e9


def measure_h2d(device: torch.device, nbytes: int = 2 * GIB, reps: int = 10) -> dict[str, Any]:
    """Pinned host -> device copy bandwidth (GB/s), on a side stream like DLO's copies: from
    memory pinned as the engine pins its slabs, and from the caching host allocator."""
    if device.type != "cuda":
        return {"registered_gbps": float("nan"), "caching-allocator_gbps": float("nan")}
    out: dict[str, Any] = {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)
    memory = host_memory(device)
    sources = {"registered": memory.allocate(nbytes)}
    sources["registered"].fill_(1)
    sources["caching-allocator"] = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    for name, host in sources.items():
        out[f"{name}_gbps"] = copy_gbps(dev, host, stream, reps)
    out["registered_backing"] = memory.kind
    memory.free(sources["registered"])
    del sources, dev
    release_host_cache()
    return out


def release_host_cache() -> None:
    """Free device memory and the caching host allocator's cached pinned blocks."""
    gc.collect()
    torch.cuda.empty_cache()
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def release_device_cache() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def host_pinned_stats() -> dict[str, int]:
    try:
        stats = torch.cuda.host_memory_stats()
    except Exception:  # not a CUDA build, or no host allocator stats in this torch
        return {}
    return {k: int(v) for k, v in stats.items() if "bytes" in k and "current" in k}


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / GIB
    return float("nan")


def guest_physical_gib(address: int) -> float | None:
    """(Guest-)physical address in GiB of the page holding ``address``, from
    /proc/self/pagemap; None where the page is not present or the frame numbers are hidden
    (they read as 0 without CAP_SYS_ADMIN)."""
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(address // 4096 * 8)
            entry = int.from_bytes(f.read(8), "little")
    except OSError:
        return None
    pfn = entry & ((1 << 55) - 1) if entry >> 63 else 0  # bit 63: present; bits 0-54: frame
    return pfn * 4096 / GIB if pfn else None


# -- profiling ------------------------------------------------------------------------------------
def profile_steps(model: torch.nn.Module, inputs: dict[str, Any], steps: int, path: Path) -> dict[str, Any]:
    """Profile steady-state steps; count host-synchronizing CUDA calls inside them.

    Each step runs under a ``bench_step`` range, so the profiler's own synchronize at stop
    (after the last step) is not counted. Also reports how busy the copy engine was. The
    trace is kept, gzipped, at ``path``.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with torch.no_grad():
        model(**inputs)  # warm
        sync()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                with record_function("bench_step"):
                    model(**inputs)
    sync()
    raw = path.with_suffix("")
    prof.export_chrome_trace(str(raw))
    result = analyze_trace(json.loads(raw.read_text())["traceEvents"], steps)
    with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
        dst.write(src.read())
    raw.unlink()
    result["trace"] = path.name
    return result


def analyze_trace(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    ranges = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("name") == "bench_step" and e.get("cat") == "user_annotation"]

    def inside(e: dict[str, Any]) -> bool:
        return any(a <= e["ts"] <= b for a, b in ranges)

    runtime = [e for e in events if e.get("cat") == "cuda_runtime" and inside(e)]
    counts = Counter(e["name"] for e in runtime)
    copies = sorted((e for e in events if e.get("cat") == "gpu_memcpy"), key=lambda e: e["ts"])
    result: dict[str, Any] = {
        "steps": steps,
        "sync_calls_per_step": {n: counts.get(n, 0) / steps for n in SYNC_CALLS},
        "memcpy_async_per_step": counts.get("cudaMemcpyAsync", 0) / steps,
        "stream_wait_event_per_step": counts.get("cudaStreamWaitEvent", 0) / steps,
    }
    if copies:
        busy = sum(e["dur"] for e in copies)
        span = copies[-1]["ts"] + copies[-1]["dur"] - copies[0]["ts"]
        nbytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in copies)
        result["h2d_busy_fraction"] = busy / span if span else None
        result["h2d_gbps_while_busy"] = nbytes / (busy * 1e-6) / 1e9 if busy else None
    return result


# -- results --------------------------------------------------------------------------------------
def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table's lines: the header, the rule, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


# -- what the serving benchmarks share (they talk to a server over HTTP) -----------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)$")


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of ``n`` requests at ``rate`` per second; rate <= 0 or inf: all at
    once."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        if 0 < rate < math.inf:
            t += rng.expovariate(rate)
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile of ``values`` (linear interpolation between ranks); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def scrape_metrics(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Every sample of the server's Prometheus ``/metrics``, by name (labels included)."""
    import httpx  # only the serving benchmarks need an HTTP client

    text = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=30).text
    samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            samples[match.group(1)] = float(match.group(2))
    return samples


def step_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the engine's step counters say about a run: steps, mean batch size and rows,
    mean step time, bytes streamed (from two ``scrape_metrics`` samples around it)."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("ditserve:step_batch_size_count")
    return {
        "denoise_steps": steps,
        "mean_batch_size": delta("ditserve:step_batch_size_sum") / steps if steps else None,
        "mean_batch_rows": delta("ditserve:step_batch_rows_sum") / steps if steps else None,
        "mean_step_s": delta("ditserve:step_time_seconds_sum") / steps if steps else None,
        "offload_bytes": delta("ditserve:offload_bytes_transferred_total"),
    }

