"""ServerState: what the routes share (engine, config, metrics), and what the server gives
the engine at construction (``engine_options``: its observers and warm-up).

The engine is an ``engine.loop.client.EngineClient``: the server reads only that protocol (never
the executor or the runner). It keeps no lifecycle of its own: it reads ``engine.phase``
(loading, compiling, ready, draining, stopped, failed) and ``engine.failure``. The lifespan starts the engine in a
worker thread (``start_engine``) so /health answers while weights load; the SIGTERM handler
calls ``begin_drain``, waits while ``has_work``, then ``stop``; the lifespan's exit calls
``stop`` too. ``engine.shutdown`` runs exactly once.

What a request may ask (``limits``, ``video_limits``) is the server's flags within the loaded
model's own limits (``engine.facts().limits``: pixel multiple, frame step, the sizes and
frame counts its positional tables reach).

One model per replica: ``output`` (from the model's family, read before it loads) says
whether this replica makes images (/v1/images/generations) or videos (/v1/videos, whose
jobs ``videos`` owns: the store, its directory and the encoding threads); ``makes_images``
whether the image route is served (a video model that makes still images serves both).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ditserve.engine.config import EngineConfig
from ditserve.engine.errors import AdapterError, ConfigError, ModelLoadError
from ditserve.engine.loop.client import EngineClient
from ditserve.engine.loop.startup import WarmUp
from ditserve.engine.loop.step_log import StepLog, copy_rates_of
from ditserve.engine.loop.step_log import log as step_logger
from ditserve.engine.loop.thread_samples import ThreadSamples
from ditserve.engine.request import MAX_FRAMES, MAX_SIDE, MAX_STEPS, ModelLimits
from ditserve.engine.server.config import ServerConfig, parse_size
from ditserve.engine.server.fields.step_cache import step_cache_policies
from ditserve.engine.server.fields.uploads import UploadLimits
from ditserve.engine.server.heap import GcPauses, freeze_startup_heap, thaw_heap
from ditserve.engine.server.jobs.backend import JobBackend
from ditserve.engine.server.jobs.files import VideoFiles
from ditserve.engine.server.jobs.results import ResultStore
from ditserve.engine.server.jobs.service import VideoJobs
from ditserve.engine.server.jobs.store import JobStore, StoreLimits
from ditserve.engine.server.limits import RequestLimits, VideoLimits
from ditserve.engine.server.metrics import ServingMetrics
from ditserve.engine.server.model_defaults import ModelDefaults, model_defaults

log = logging.getLogger(__name__)
SQLITE_FILE = "jobs.sqlite3"  # the default job store, under --video-dir

TINY_MODEL_NAME = "ditserve-tiny-flux"
# A video model's frame step before it loaded (Wan's VAE: 4 frames per latent frame).
VIDEO_FRAME_STEP = 4


@dataclass
class ServerState:
    engine: EngineClient
    config: ServerConfig
    metrics: ServingMetrics
    model_name: str
    default_size: tuple[int, int]
    default_steps: int
    model: ModelDefaults = field(default_factory=lambda: model_defaults(None))
    videos: VideoJobs | None = None
    on_start_failed: Callable[[BaseException], None] | None = None
    _stop_lock: threading.Lock = field(default_factory=threading.Lock)
    _stopped: bool = False
    _gc_pauses: GcPauses = field(default_factory=GcPauses)

    @classmethod
    def build(cls, engine: EngineClient, config: ServerConfig, *, metrics: ServingMetrics | None = None,
              **kwargs: Any) -> ServerState:
        """metrics: the ServingMetrics the engine was given as an observer (``engine_options``);
        without one, only HTTP-level and scrape-time metrics are exported."""
        name = config.model_name or _model_name(engine.config)
        if name in engine.config.adapters.lora_modules:
            # ``model`` selects an adapter by name: this one could never be (the runtime
            # route refuses the same name, 400 adapter_name_taken).
            raise ConfigError(f"--lora-modules {name}=...: {name!r} is the served model's "
                              "name (--served-model-name), so requests could never select the "
                              "adapter; give it another name")
        size, steps = _defaults(engine.config, config)
        metrics = metrics or ServingMetrics(lambda: engine)
        model = model_defaults(engine.config.model)
        videos = None
        if model.output == "video":
            store = open_job_store(config, namespace=config.job_namespace or name,
                                   observer=metrics)
            metrics.track_videos(store.usage)
            videos = VideoJobs(engine, store, lease_s=config.job_lease_s)
        return cls(engine, config, metrics, name, size, steps, model, videos, **kwargs)

    @property
    def output(self) -> str:
        """What this replica makes: "image" or "video"."""
        return self.model.output

    @property
    def makes_images(self) -> bool:
        """Whether /v1/images/generations is served: an image replica, or a video replica
        whose model makes still images (its one-frame video: Cosmos3's text-to-image)."""
        # An edit-only model (its requests need an input image: Qwen-Image-Edit) serves only
        # /v1/images/edits; known once it loaded.
        return self.model.makes_images and self.model_limits().condition_images[0] == 0

    def model_limits(self) -> ModelLimits:
        """The loaded model's own limits; before it loaded, the usual ones of its kind."""
        facts = self.engine.facts()
        if facts is not None:
            return facts.limits
        if self.output == "video":
            return ModelLimits(frame_step=VIDEO_FRAME_STEP, max_frames=MAX_FRAMES)
        return ModelLimits()

    def limits(self) -> RequestLimits:
        """What a request may ask for now: the server's flags within the model's limits."""
        config, model = self.config, self.model_limits()
        max_steps = min(config.max_steps or MAX_STEPS, MAX_STEPS)
        max_side = min(config.max_side or MAX_SIDE, model.max_side)
        max_side -= max_side % model.pixel_multiple
        return RequestLimits(
            model_name=self.model_name,
            default_size=fitted_size(self.default_size, max_side, model.pixel_multiple),
            # A model's default (Flux-dev's 28) never exceeds what --max-steps allows.
            default_steps=min(self.default_steps, max_steps),
            pixel_multiple=model.pixel_multiple, max_prompt_chars=model.max_prompt_chars,
            max_side=max_side,
            max_steps=max_steps, default_guidance=self.model.guidance,
            step_cache_policies=step_cache_policies(self.engine),
            default_true_cfg=self.model.true_cfg,
            max_text_tokens=model.max_text_tokens or RequestLimits.max_text_tokens,
        )

    def upload_limits(self) -> UploadLimits:
        """How large an uploaded image (and the body carrying it) may be."""
        return UploadLimits(max_bytes=self.config.max_upload_bytes,
                            max_pixels=self.config.max_image_pixels)

    def video_limits(self) -> VideoLimits:
        """What a video job may ask for now (frame step and pixel multiple once loaded; Wan's
        4 before). The default frame count is rounded down to one the bounds allow."""
        config, model = self.config, self.model
        frame_step = self.model_limits().frame_step or VIDEO_FRAME_STEP
        max_frames = min(config.max_frames or MAX_FRAMES, self.model_limits().max_frames)
        max_frames -= (max_frames - 1) % frame_step
        default = min(config.default_frames or model.frames, max_frames)
        images = self.limits()
        return VideoLimits(
            model_name=self.model_name, default_size=images.default_size,
            default_steps=images.default_steps,
            default_frames=default - (default - 1) % frame_step,
            default_fps=config.default_fps or model.fps, default_guidance=model.guidance,
            pixel_multiple=images.pixel_multiple, frame_step=frame_step,
            max_prompt_chars=images.max_prompt_chars, max_side=images.max_side,
            max_steps=images.max_steps, max_frames=max_frames,
            step_cache_policies=images.step_cache_policies,
            max_text_tokens=images.max_text_tokens, audio=self.model_limits().audio,
            references=self.model_limits().references,
            min_frames=self.model_limits().min_frames,
        )

    def start_engine(self) -> None:
        """Blocking; run in a thread. A failure is recorded and reported, never raised."""
        try:
            self.metrics.track_gc(self._gc_pauses.install().totals)
            self.engine.start()  # a failure leaves the engine FAILED, with the reason
            log.info("engine ready: serving %s", self.model_name)
            wanted = self.config.default_frames
            served = self.video_limits().default_frames if self.output == "video" else wanted
            if wanted and served != wanted:
                log.warning("--default-frames %d: this model makes %d frames instead (the "
                            "nearest count it can make at most as long)", wanted, served)
            freeze_startup_heap()  # collections skip startup's objects from now on (heap)
        except BaseException as e:
            if isinstance(e, (ConfigError, ModelLoadError, AdapterError)):
                # An operator's mistake whose message says how to fix it: the clear line
                # follows (main), a traceback above it would only bury it.
                log.debug("engine failed to start", exc_info=True)
            else:
                log.exception("engine failed to start")
            if self.on_start_failed is not None:
                self.on_start_failed(e)

    def begin_drain(self) -> None:
        """Refuse new work from now on (/ready 503, new requests 503, no job is claimed);
        admitted work goes on."""
        self.engine.drain()
        if self.videos is not None:
            self.videos.begin_drain()

    def has_work(self) -> bool:
        stats = self.engine.stats()
        return stats.running + stats.waiting > 0 or (
            self.videos is not None and self.videos.busy())

    def stop(self, grace_seconds: float = 0.0) -> None:
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        self.engine.shutdown(grace_seconds)
        if self.videos is not None:
            self.videos.close()  # after the engine: its aborts fail the unfinished jobs
        self._gc_pauses.remove()
        thaw_heap()
        log.info("engine stopped")


def open_job_store(config: ServerConfig, *, namespace: str, observer: Any = None) -> JobStore:
    """The job store ``config`` names (``--job-store``: SQLite by default, or Redis) with its
    video directory: an owned one (one server, swept of files no job names) for SQLite, a
    shared one (every replica mounts it) for Redis; results go to that directory, or to the
    bucket ``--job-results s3://...`` names (then the directory keeps only the SQLite file)."""
    limits = StoreLimits(max_jobs=config.video_max_jobs, max_bytes=config.video_max_bytes,
                         ttl_s=config.video_ttl_s)
    shared = config.job_store is not None and not config.job_store.startswith("sqlite:")
    files = VideoFiles(config.video_dir, shared=shared)
    results: ResultStore = files
    try:
        backend = open_backend(config.job_store, files.root, namespace=namespace,
                               clock=time.time)
        files.sweep({job.id for job in backend.jobs()})
        if config.job_results is not None:
            from ditserve.engine.server.jobs.s3_results import S3Results

            results = S3Results(config.job_results)
    except BaseException:
        files.close()
        raise
    return JobStore(limits, results, backend, observer=observer, directory=files)


def open_backend(url: str | None, video_dir: Path, *, namespace: str,
                 clock: Callable[[], float]) -> JobBackend:
    """The backend ``url`` names (None: ``sqlite:///<video_dir>/jobs.sqlite3``).
    ``namespace`` keeps deployments apart in one Redis (their jobs and queues never mix)."""
    from ditserve.engine.server.jobs.sqlite_backend import SqliteBackend

    if url is None:
        return SqliteBackend(video_dir.resolve() / SQLITE_FILE, clock=clock)
    scheme = urlsplit(url).scheme
    if scheme == "sqlite":
        return SqliteBackend(sqlite_path(url), clock=clock)
    if scheme in ("redis", "rediss", "unix"):
        from ditserve.engine.server.jobs.redis_backend import RedisBackend

        backend = RedisBackend(url, namespace=namespace)
        try:
            backend.check_database()
        except ValueError as e:
            raise ConfigError(f"server.job_store: {e}") from e
        return backend
    raise ConfigError(f"server.job_store: {scheme!r} is no job store; use sqlite:///PATH or "
                      "redis://HOST:PORT/DB")


def sqlite_path(url: str) -> Path:
    """``sqlite:///abs/path`` -> /abs/path (what follows ``sqlite://`` is the file's path,
    which must be absolute)."""
    path = url.removeprefix("sqlite://")
    if not path.startswith("/"):
        raise ConfigError(f"server.job_store {url!r}: write sqlite:///ABSOLUTE/PATH (an "
                          "absolute file path)")
    return Path(path)


def engine_options(engine_config: EngineConfig, config: ServerConfig, metrics: ServingMetrics,
                   engine_fn: Callable[[], Any]) -> dict[str, Any]:
    """The DiffusionEngine keyword arguments of a server: the observers (``metrics`` and the
    step log, which reads copy rates from ``engine_fn()``) and the warm-up, which with
    --compile compiles at the default size so no request after /ready waits for a compile."""
    width, height = _defaults(engine_config, config)[0]
    # At DEBUG a slow gap between steps names where each thread was (engine/loop/thread_samples).
    samples = ThreadSamples() if step_logger.isEnabledFor(logging.DEBUG) else None
    step_log = StepLog(copy_rates=lambda: copy_rates_of(engine_fn().offload_report()),
                       samples=samples)
    return {"observers": [metrics, step_log], "warmup": WarmUp(compile_size=(height, width))}


def _model_name(engine_config: EngineConfig) -> str:
    return Path(engine_config.model).name if engine_config.model else TINY_MODEL_NAME


def _defaults(engine_config: EngineConfig, config: ServerConfig) -> tuple[tuple[int, int], int]:
    """The (width, height) and step count a request gets when it names none: the server's
    flags, else the model's own (``model_defaults``)."""
    defaults = model_defaults(engine_config.model)
    size = parse_size(config.default_size) if config.default_size else None
    size = size or (defaults.width, defaults.height)  # ServerConfig validated the pattern
    return size, config.default_steps or defaults.steps


def fitted_size(size: tuple[int, int], max_side: int, multiple: int) -> tuple[int, int]:
    """The model's default (width, height) scaled down, aspect kept, to fit ``max_side`` (as
    the default steps fit ``max_steps``), each side a multiple of the model's pixel step."""
    width, height = size
    if max(width, height) <= max_side:
        return size
    scale = max_side / max(width, height)
    return tuple(max(multiple, int(side * scale) // multiple * multiple)  # type: ignore[return-value]
                 for side in (width, height))
