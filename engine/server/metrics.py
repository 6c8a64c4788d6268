"""Prometheus metrics of one replica, with vLLM-style ``ditserve:`` names.

``ServingMetrics`` is both an ``EngineObserver`` (the engine calls ``on_step``,
``on_finished`` and ``on_failed`` from its loop thread; prometheus_client is thread-safe) and
the counter of HTTP-level errors. Gauges that mirror engine state (running, waiting, offload
bytes) are read at scrape time by a collector, so they can never drift. Each app owns its own
registry, so several apps (tests) never share series.

On a video replica it is also the job store's observer (``on_job_finished``: jobs by final
status, seconds of video stored) and reads the store's jobs by status and bytes at scrape
time (``track_videos``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ditserve.engine.loop.client import EngineClient, EnginePhase
from ditserve.engine.loop.step_log import copy_rates_of
from ditserve.engine.server.jobs.errors import StoreUnavailable
from ditserve.engine.server.jobs.model import FINISHED_LABELS, JobStatus

if TYPE_CHECKING:
    from ditserve.engine.loop.results import EngineStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
                   120.0, 300.0, 600.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
GROUP_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)
# Rows x latent tokens of a step: a 1024x1024 Flux image is 4096, an 81-frame 832x480 Wan
# video 32760.
TOKEN_BUCKETS = (256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288)
# Error reasons are a closed set so the label never explodes.
ERROR_REASONS = ("invalid_request", "model_not_found", "not_found", "method_not_allowed",
                 "unauthorized", "payload_too_large", "queue_full", "store_full",
                 "unavailable", "timeout", "client_disconnect", "engine_error", "internal",
                 "deadline")


class _GcCollector(Collector):
    """The garbage collector's passes and seconds by generation (``server.heap.GcPauses``):
    a full pass (generation 2) holds every thread, the step loop's too."""

    def __init__(self, totals: Callable[[], tuple[Sequence[float], Sequence[int]]]) -> None:
        self._totals = totals

    def collect(self) -> Iterator[Metric]:
        pause = CounterMetricFamily("ditserve:gc_pause_seconds", "Seconds in garbage "
                                    "collection, by generation.", labels=["generation"])
        count = CounterMetricFamily("ditserve:gc_collections", "Garbage collector passes, "
                                    "by generation.", labels=["generation"])
        for generation, (seconds, passes) in enumerate(zip(*self._totals(), strict=True)):
            pause.add_metric([str(generation)], seconds)
            count.add_metric([str(generation)], passes)
        yield from (pause, count)


class _VideoStoreCollector(Collector):
    """Reads the video job store at scrape time: jobs held by status (with a shared store,
    every replica's: ``status="queued"`` is the shared queue's depth), bytes held, and
    whether the store answered."""

    def __init__(self, usage: Callable[[], tuple[dict[str, int], int]]) -> None:
        self._usage = usage

    def collect(self) -> Iterator[Metric]:
        try:
            counts, used = self._usage()
        except StoreUnavailable:
            yield GaugeMetricFamily("ditserve:job_store_up",
                                    "Whether the video job store answered this scrape.", 0)
            return
        yield GaugeMetricFamily("ditserve:job_store_up",
                                "Whether the video job store answered this scrape.", 1)
        jobs = GaugeMetricFamily("ditserve:video_jobs",
                                 "Video jobs held by the store, by status.", labels=["status"])
        for status, count in counts.items():
            jobs.add_metric([status], count)
        yield jobs
        # The queue an autoscaler reads (docs/kubernetes.md): work admitted and not done.
        yield GaugeMetricFamily("ditserve:video_jobs_unfinished",
                                "Video jobs queued or in progress in the store (with a "
                                "shared store, the deployment's: every replica reports the "
                                "same number).",
                                value=sum(counts.get(s.label, 0) for s in JobStatus
                                          if not s.is_finished))
        yield GaugeMetricFamily("ditserve:video_store_bytes",
                                "Bytes of stored MP4s plus the reservations of unfinished "
                                "jobs (bounded by --video-max-bytes).", value=used)


class _EngineStateCollector(Collector):
    """Reads running/waiting counts and offload totals from the engine at scrape time."""

    def __init__(self, engine_fn: Callable[[], EngineClient | None]) -> None:
        self._engine_fn = engine_fn

    def collect(self) -> Iterator[Metric]:
        engine = self._engine_fn()
        stats = engine.stats() if engine is not None else None
        yield from _request_metrics(engine, stats)
        yield from _pipeline_metrics(engine, stats)
        yield from _offload_metrics(engine.offload_report() if engine is not None else None)
        yield from _start_metrics(engine.start_report() if engine is not None else None)


def _request_metrics(engine: EngineClient | None, stats: EngineStats | None) -> Iterator[Metric]:
    """The queue and the lifecycle: running, waiting, paused, the step estimate, ready."""
    yield GaugeMetricFamily("ditserve:num_requests_running",
                            "Requests in the running denoise batch.",
                            value=stats.running if stats else 0)
    yield GaugeMetricFamily("ditserve:num_requests_waiting",
                            "Requests admitted to the queue, waiting for a batch slot.",
                            value=stats.waiting if stats else 0)
    yield GaugeMetricFamily("ditserve:num_requests_paused",
                            "Requests paused at a step boundary for higher-priority ones "
                            "(--scheduling-policy priority).",
                            value=stats.paused if stats else 0)
    yield GaugeMetricFamily("ditserve:num_requests_waiting_high_priority",
                            "Waiting requests of a priority below the default 0 (sooner); "
                            "an autoscaling signal for interactive traffic.",
                            value=stats.waiting_high_priority if stats else 0)
    if stats is not None and stats.step_seconds is not None:
        yield GaugeMetricFamily("ditserve:scheduler_step_seconds_estimate",
                                "The scheduler's measured period of a busy step, from "
                                "which deadline estimates are made (s).", value=stats.step_seconds)
    ready = engine is not None and engine.phase is EnginePhase.READY
    yield GaugeMetricFamily("ditserve:engine_ready",
                            "1 when the model is loaded, warmed up and admitting.",
                            value=1.0 if ready else 0.0)


def _start_metrics(report: dict[str, Any] | None) -> Iterator[Metric]:
    """Where this replica's start went: seconds per phase, and process start to ready."""
    phases = GaugeMetricFamily("ditserve:start_phase_seconds",
                               "Seconds this replica's start spent per phase (process, "
                               "cuda_init, read, place, pin_register, encoders, warm_up, "
                               "compile, load).", labels=["phase"])
    for name, seconds in ((report or {}).get("phases") or {}).items():
        phases.add_metric([name], float(seconds))
    yield phases
    total = (report or {}).get("start_to_ready_s")
    if total is not None:
        yield GaugeMetricFamily("ditserve:start_to_ready_seconds",
                                "Seconds from process start to ready (model loaded, warmed up).",
                                value=float(total))


def _pipeline_metrics(engine: EngineClient | None, stats: EngineStats | None
                      ) -> Iterator[Metric]:
    """The prompt-embedding cache, LoRA adapters and the step cache."""
    pipeline = engine.pipeline_report() if engine is not None else None
    cache = (pipeline or {}).get("prompt_cache") or {}
    yield CounterMetricFamily("ditserve:prompt_cache_hits",
                              "Prompt encodings served from the prompt-embedding cache.",
                              value=float(cache.get("hits", 0)))
    yield CounterMetricFamily("ditserve:prompt_cache_misses",
                              "Prompt encodings that ran the text encoder (cache on).",
                              value=float(cache.get("misses", 0)))
    yield GaugeMetricFamily("ditserve:prompt_cache_bytes",
                            "Device bytes the cached prompt embeddings take.",
                            value=float(cache.get("bytes", 0)))
    encode = (pipeline or {}).get("encode") or {}
    yield CounterMetricFamily("ditserve:encoder_passes",
                              "Batched text-encoder passes (one per step with cache misses).",
                              value=float(encode.get("passes", 0)))
    yield CounterMetricFamily("ditserve:encoder_prompts_ahead",
                              "Prompts a batched encoder pass encoded for requests not yet "
                              "admitted (the next in line), into the prompt cache.",
                              value=float(encode.get("ahead", 0)))
    memory = (pipeline or {}).get("memory") or {}
    yield GaugeMetricFamily("ditserve:hbm_predicted_peak_bytes",
                            "The whole pipeline's predicted HBM peak at start (the plan), "
                            "allocator slack not included.",
                            value=float(memory.get("predicted_peak_bytes", 0)))
    yield GaugeMetricFamily("ditserve:hbm_budget_bytes",
                            "The HBM budget the plan was made for (0: none set).",
                            value=float(memory.get("budget_bytes", 0)))
    lora = engine.adapter_stats() if engine is not None else {}
    yield GaugeMetricFamily("ditserve:lora_adapters_loaded",
                            "LoRA adapters loaded (selectable by name).",
                            value=lora.get("loaded", 0))
    yield GaugeMetricFamily("ditserve:lora_adapters_resident",
                            "LoRA adapters resident on the device (rank 0; at most "
                            "--max-loras).",
                            value=lora.get("resident", 0))
    yield GaugeMetricFamily("ditserve:lora_resident_bytes",
                            "Device bytes of the resident LoRA adapters' factors (rank 0).",
                            value=float(lora.get("bytes", 0)))
    yield CounterMetricFamily("ditserve:step_cache_skipped_blocks",
                              "Block computations (one request through one DiT block) the "
                              "step cache skipped by reusing a cached residual.",
                              value=float(stats.step_cache_skipped_blocks if stats else 0))
    yield CounterMetricFamily("ditserve:step_cache_skipped_bytes",
                              "Streamed block bytes DLO did not copy because no request of "
                              "their step computed them (step cache).",
                              value=float(stats.step_cache_skipped_bytes if stats else 0))


def _offload_metrics(report: dict[str, Any] | None) -> Iterator[Metric]:
    """Layerwise offload: bytes streamed, the host backing and its copy rate per rank."""
    transferred = float((report or {}).get("bytes_transferred", 0))
    yield CounterMetricFamily("ditserve:offload_bytes_transferred",
                              "Weight bytes streamed host->device by layerwise offload.",
                              value=transferred)
    if not report:
        return
    # Which host backing and transfer path DLO uses, and why it fell back (if it did).
    info = GaugeMetricFamily(
        "ditserve:offload_host_backing_info",
        "1 for the DLO host backing in use; labels: backing kind (ordinary, "
        "checkpoint_mmap, runtime_cache), transfer path, fallback reason (empty: none).",
        labels=["backing_kind", "transfer_path", "fallback_reason"])
    reason = report.get("fallback_reason") or (
        report.get("backing_reason", "") if report.get("backing_kind") == "ordinary" else "")
    info.add_metric([str(report.get("backing_kind", "ordinary")),
                     str(report.get("transfer_path", "")), str(reason)[:200]], 1.0)
    yield info
    yield GaugeMetricFamily("ditserve:offload_pinned_host_bytes",
                            "Page-locked host bytes of DLO (slabs, registered "
                            "mappings or staging slots).",
                            value=float(report.get("pinned_host_bytes", 0)))
    rates = GaugeMetricFamily(
        "ditserve:offload_h2d_bytes_per_second",
        "Host->device rate the DLO weight copies reached over the last few hundred "
        "block loads, timed on the GPU; per rank.", labels=["rank"])
    for rank, rate in enumerate(copy_rates_of(report)):
        if rate is not None:
            rates.add_metric([str(rank)], rate * 1e9)
    yield rates


class ServingMetrics:
    """Every metric of the server; see the module docstring."""

    def __init__(self, engine_fn: Callable[[], EngineClient | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_time = Histogram(
            "ditserve:request_queue_time_seconds",
            "Time from admission to the first denoise step.", buckets=LATENCY_BUCKETS,
            registry=r)
        self.e2e_latency = Histogram(
            "ditserve:e2e_request_latency_seconds",
            "Time from admission to the decoded image.", buckets=LATENCY_BUCKETS, registry=r)
        self.step_time = Histogram(
            "ditserve:step_time_seconds", "Wall time of one batched denoise step.",
            buckets=STEP_BUCKETS, registry=r)
        self.step_batch_size = Histogram(
            "ditserve:step_batch_size", "Requests in one denoise step.", buckets=BATCH_BUCKETS,
            registry=r)
        self.step_batch_rows = Histogram(
            "ditserve:step_batch_rows",
            "Rows (images, doubled under true CFG) in one denoise step.",
            buckets=BATCH_BUCKETS, registry=r)
        self.step_shape_groups = Histogram(
            "ditserve:step_shape_groups",
            "Shape groups (token grids; one forward each, block-major under DLO) in one "
            "denoise step.", buckets=GROUP_BUCKETS, registry=r)
        self.step_batch_tokens = Histogram(
            "ditserve:step_batch_tokens",
            "Work of one denoise step: rows x latent tokens over its requests (what "
            "--max-batch-tokens bounds).", buckets=TOKEN_BUCKETS, registry=r)
        self.images = Counter("ditserve:images_generated", "Images generated.", registry=r)
        self.videos = Counter("ditserve:videos_generated",
                              "Videos the engine generated (decoded, before encoding).",
                              registry=r)
        self.video_jobs_finished = Counter(
            "ditserve:video_jobs_finished", "Video jobs that ended, by final status.",
            ["status"], registry=r)
        for status in FINISHED_LABELS:
            self.video_jobs_finished.labels(status=status)
        self.video_seconds = Counter(
            "ditserve:video_seconds_generated",
            "Seconds of video stored by completed jobs (frames / fps).", registry=r)
        self.success = Counter("ditserve:request_success", "Requests that returned images.",
                               registry=r)
        self.errors = Counter("ditserve:request_errors", "Requests that ended in an error.",
                              ["reason"], registry=r)
        for reason in ERROR_REASONS:
            self.errors.labels(reason=reason)  # export zeros so rates work from the start
        self.engine_failures = Counter(
            "ditserve:engine_request_failures",
            "Requests the engine failed (encode, denoise or decode error).", registry=r)
        self.preemptions = Counter(
            "ditserve:num_preemptions",
            "Requests paused at a step boundary for a higher-priority request.", registry=r)
        self.paused_time = Histogram(
            "ditserve:request_paused_seconds",
            "How long a paused request waited before it resumed.", buckets=LATENCY_BUCKETS,
            registry=r)
        self.deadline_exceeded = Counter(
            "ditserve:deadline_exceeded",
            "Requests stopped at a step boundary because they could no longer meet their "
            "deadline_s.", registry=r)
        r.register(_EngineStateCollector(engine_fn))

    # -- EngineObserver (called from the engine thread) ---------------------------------------
    def on_step(self, *, requests: int, rows: int, seconds: float, groups: int = 1,
                tokens: int = 0) -> None:
        self.step_time.observe(seconds)
        self.step_batch_size.observe(requests)
        self.step_batch_rows.observe(rows)
        self.step_shape_groups.observe(groups)
        self.step_batch_tokens.observe(tokens)

    def on_finished(self, result: Any) -> None:
        self.queue_time.observe(result.queue_seconds)
        self.e2e_latency.observe(result.latency_seconds)
        (self.videos if result.is_video else self.images).inc(result.num_images)

    def on_failed(self, request_id: str, reason: str) -> None:
        self.engine_failures.inc()

    def on_preempted(self, request_id: str) -> None:
        self.preemptions.inc()

    def on_resumed(self, request_id: str, seconds: float) -> None:
        self.paused_time.observe(seconds)

    def on_deadline_exceeded(self, request_id: str) -> None:
        self.deadline_exceeded.inc()

    # -- video jobs (JobStore's observer) -------------------------------------------------------
    def on_job_finished(self, status: str, video_seconds: float) -> None:
        self.video_jobs_finished.labels(status=status).inc()
        self.video_seconds.inc(video_seconds)

    def track_videos(self, usage: Callable[[], tuple[dict[str, int], int]]) -> None:
        self.registry.register(_VideoStoreCollector(usage))

    def track_gc(self, totals: Callable[[], tuple[Sequence[float], Sequence[int]]]) -> None:
        self.registry.register(_GcCollector(totals))

    # -- HTTP layer -------------------------------------------------------------------------
    def count_error(self, reason: str) -> None:
        self.errors.labels(reason=reason if reason in ERROR_REASONS else "internal").inc()

    def count_success(self) -> None:
        self.success.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
