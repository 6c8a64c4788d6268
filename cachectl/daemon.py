"""The per-node daemon (``cachectl serve``): HTTP API on a Unix socket, scrub, metrics.

Owns ``DaemonConfig``, the FastAPI app and socket setup. Endpoints:

    GET  /healthz              liveness, root, entry count
    POST /v1/ensure            {model, dtype, revision, sp_size, sp_impl, component, checkpoint,
                                wait_s} -> 200 ready /
                               202 building /
                               400 bad request / 409 corrupt entry / 500 failed
    POST /v1/pull              {uri, credentials, workers, wait_s} -> 200 ready / 202 downloading /
                               400 bad URI / 404 not found / 403 unauthorized / 409 corrupt /
                               507 disk full / 502 other source failures (``reason`` says which)
    PUT  /v1/compile/{key}     an engine's compiled artifacts (torch's mega-cache, raw bytes),
                               published atomically as v1/compile/<key>.bin -> 200 / 400 / 413
    GET  /v1/entries/{key}     status of one entry (structure checked, not re-hashed)
    GET  /metrics              Prometheus text (also on --metrics-port, bound to --metrics-host:
                               $POD_IP or the loopback, never every address by default)

Every answer is JSON, errors included. The handlers are thin: they validate the body and call
the build coordinator or the store. The daemon builds with the ModelLoader it is given (the
CLI passes the engine's); on SIGTERM it stops answering, lets a running build finish within
``grace_s`` and then exits 0, or says it abandoned the build and exits 3.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest, start_http_server
from pydantic import BaseModel, Field

from ditserve.cachectl.builds import BuildCoordinator, JobStatus
from ditserve.cachectl.compiled import publish_compiled
from ditserve.cachectl.errors import CacheError, UsageError
from ditserve.cachectl.identity import Placement, is_key
from ditserve.cachectl.logs import event
from ditserve.cachectl.metrics import DaemonMetrics
from ditserve.cachectl.model_build import ModelLoader, ModelRequest
from ditserve.cachectl.node_status import NodeStatusReporter
from ditserve.cachectl.pull_jobs import PullCoordinator, PullStatus
from ditserve.cachectl.pulled_gc import list_models
from ditserve.cachectl.pulls import PullRequest
from ditserve.cachectl.scrub import Scrubber
from ditserve.cachectl.sources import Credentials
from ditserve.cachectl.store import CacheStore
from ditserve.cachectl.verify import check_structure


@dataclass(frozen=True)
class DaemonConfig:
    """Validated once by the CLI; see ``cachectl serve --help`` for each option."""

    root: Path
    socket_path: Path
    tcp: tuple[str, int] | None = None
    metrics_port: int | None = None
    metrics_host: str | None = None  # None: $POD_IP, else the loopback
    scrub_interval_s: float = 6 * 3600.0
    scrub_rate_mib_s: float = 256.0
    max_builds: int = 2
    grace_s: float = 45.0
    socket_mode: int = 0o666

    def __post_init__(self) -> None:
        if self.scrub_interval_s < 0 or self.scrub_rate_mib_s < 0:
            raise CacheError("--scrub-interval and --scrub-rate-mib must be >= 0 (0 disables)")
        if self.max_builds < 1:
            raise CacheError("max_builds must be >= 1")
        if self.grace_s < 0:
            raise CacheError("--grace-period must be >= 0 seconds")

    @property
    def metrics_address(self) -> str:
        return self.metrics_host or os.environ.get("POD_IP") or "127.0.0.1"


class EnsureBody(BaseModel):
    model: str = Field(min_length=1, description="local diffusers model directory")
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    revision: str | None = None
    sp_size: int = Field(1, ge=1, description="sequence-parallel world size (identity)")
    sp_impl: str | None = None
    component: str = Field("transformer", min_length=1, max_length=64,
                           pattern=r"^[A-Za-z0-9_]+$",
                           description="which DiT of the model (Wan 2.2: transformer_2)")
    checkpoint: str | None = Field(None, min_length=1,
                                   description="a DiT checkpoint file served with `model` as "
                                               "its base (single-file, GGUF or FP8)")
    wait_s: float = Field(0.0, ge=0, le=3600, description="long-poll up to this many seconds")


class PullBody(BaseModel):
    uri: str = Field(min_length=1, max_length=1024, description="hf://org/repo[@rev] or s3://b/p")
    # Only the names pull_command.CREDENTIAL_ENV sends; never logged or reported.
    credentials: dict[str, str] = Field(default_factory=dict)
    workers: int = Field(8, ge=1, le=64)
    wait_s: float = Field(0.0, ge=0, le=3600, description="long-poll up to this many seconds")


MAX_COMPILE_ARTIFACT_BYTES = 4 << 30


_PULL_FAILURE_CODE = {"NotFound": 404, "Unauthorized": 403, "corrupt": 409, "DiskFull": 507,
                      "cancelled": 503, "DigestMismatch": 502, "SourceError": 502}


class Daemon:
    """The daemon's parts, apart from the sockets (tests drive it in-process)."""

    def __init__(self, config: DaemonConfig, logger: logging.Logger, loader: ModelLoader, *,
                 store: CacheStore | None = None) -> None:
        self.config = config
        self.logger = logger
        self.store = store or CacheStore(config.root)
        self.metrics = DaemonMetrics(self.store)
        self.builds = BuildCoordinator(self.store, self.metrics, logger, loader,
                                       max_builds=config.max_builds)
        self.pulls = PullCoordinator(self.store, logger, max_pulls=config.max_builds)
        rate = config.scrub_rate_mib_s * 2**20 if config.scrub_rate_mib_s else None
        self.scrubber = Scrubber(self.store, self.metrics, logger,
                                 interval_s=config.scrub_interval_s, rate_bytes_per_s=rate)
        # In a pod with $NODE_NAME: the node's NodeCache object (None elsewhere).
        self.node_status = NodeStatusReporter.from_env(
            root=str(config.root), entries=self.store.list, jobs=self.builds.jobs, logger=logger,
            models=lambda: list_models(self.store.layout), pulls=self.pulls.jobs)

    def start(self) -> None:
        self.scrubber.start()
        if self.node_status is not None:
            self.node_status.start()

    def stop(self) -> list[str]:
        """Stop scrubbing and drain builds; the recipe keys of builds abandoned after the
        grace period (empty when every running build finished)."""
        self.scrubber.stop()
        self.pulls.stop()
        if self.node_status is not None:
            self.node_status.stop()
        return [job.recipe_key for job in self.builds.drain(self.config.grace_s)]


_STATUS_CODE = {JobStatus.READY: 200, JobStatus.BUILDING: 202}


def _add_download_routes(app: FastAPI, daemon: Daemon) -> None:
    """``POST /v1/pull`` (models from hf:// or s3://) and ``PUT /v1/compile/{key}``."""

    @app.post("/v1/pull")
    async def pull(body: PullBody) -> JSONResponse:
        try:
            unknown = set(body.credentials) - {f.name for f in dataclasses.fields(Credentials)}
            if unknown:
                raise UsageError(f"unknown credential fields {sorted(unknown)}")
            request = PullRequest(body.uri, Credentials(**body.credentials), workers=body.workers)
            job = await asyncio.to_thread(daemon.pulls.submit, request)
        except CacheError as e:
            return JSONResponse({"status": "failed", "reason": "bad_request", "error": str(e)}, 400)
        if body.wait_s > 0 and not job.future.done():
            # shield: a client that gives up must not cancel the shared download.
            await asyncio.wait({asyncio.shield(asyncio.wrap_future(job.future))},
                               timeout=body.wait_s)
        snap = job.snapshot()
        if job.status is PullStatus.READY:
            return JSONResponse(snap, 200)
        if job.status is PullStatus.DOWNLOADING:
            return JSONResponse(snap, 202)
        return JSONResponse(snap, _PULL_FAILURE_CODE.get(job.reason or "", 500))

    @app.put("/v1/compile/{key}")
    async def compile_artifacts(key: str, request: Request) -> JSONResponse:
        # Engine pods mount the cache read-only; the daemon publishes what they compiled.
        if not is_key(key):
            return JSONResponse({"error": "not a compile key (64 lowercase hex digits)"}, 400)
        data = await request.body()
        if not data or len(data) > MAX_COMPILE_ARTIFACT_BYTES:
            return JSONResponse({"error": f"expected 1 to {MAX_COMPILE_ARTIFACT_BYTES} bytes"},
                                413)
        path = await asyncio.to_thread(publish_compiled, daemon.store.root, key, data)
        event(daemon.logger, "compile_artifacts_saved", key=key, bytes=len(data))
        return JSONResponse({"status": "ready", "path": str(path), "bytes": len(data)}, 200)


def create_app(daemon: Daemon) -> FastAPI:
    app = FastAPI(title="cachectl", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(Exception)
    async def unexpected(_request: Any, exc: Exception) -> JSONResponse:
        # Clients parse every answer as JSON; an unexpected error is a 500 in JSON too.
        event(daemon.logger, "request_failed", logging.ERROR, error=repr(exc))
        return JSONResponse({"status": "failed", "reason": "error", "error": str(exc)}, 500)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        return {"status": "ok", "root": str(daemon.store.root), "entries": len(daemon.store.keys())}

    @app.post("/v1/ensure")
    async def ensure(body: EnsureBody) -> JSONResponse:
        try:
            placement = Placement(sp_size=body.sp_size, sp_impl=body.sp_impl)
            request = ModelRequest(Path(body.model), body.dtype, body.revision, placement,
                                   component=body.component,
                                   checkpoint=None if body.checkpoint is None
                                   else Path(body.checkpoint))
            job = await asyncio.to_thread(daemon.builds.submit, request)
        except CacheError as e:
            return JSONResponse({"status": "failed", "reason": "bad_request", "error": str(e)}, 400)
        except Exception as e:  # an unexpected failure while planning: still a JSON answer
            event(daemon.logger, "ensure_failed", logging.ERROR, error=repr(e))
            return JSONResponse({"status": "failed", "reason": "error", "error": str(e)}, 500)
        if body.wait_s > 0 and not job.future.done():
            # shield: a client that gives up must not cancel the shared build.
            await asyncio.wait({asyncio.shield(asyncio.wrap_future(job.future))},
                               timeout=body.wait_s)
        snap = job.snapshot()
        code = _STATUS_CODE.get(job.status, 409 if job.reason == "corrupt" else 500)
        return JSONResponse(snap, code)

    _add_download_routes(app, daemon)

    @app.get("/v1/entries/{key}")
    def entry(key: str) -> JSONResponse:
        if not is_key(key):
            return JSONResponse({"error": "not an entry key (64 lowercase hex digits)"}, 400)
        info = next((i for i in daemon.store.list() if i.key == key), None)
        if info is None:
            return JSONResponse({"key": key, "status": "missing"}, 404)
        _, problems = check_structure(info.path, key)
        body = {**info.to_json(), "path": str(info.path),
                "status": "corrupt" if problems else "ready",
                "problems": [str(p) for p in problems]}
        return JSONResponse(body, 200)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(daemon.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


_SUN_PATH_MAX = 107  # sockaddr_un's sun_path, less its terminating NUL (Linux)


def _bind_unix(path: Path, mode: int) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # a dead daemon's socket file
        else:
            raise CacheError(f"another daemon already serves {path}; stop it or pass --socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
    except OSError as e:  # e.g. a path over the 107 bytes a Unix socket address holds
        sock.close()
        raise CacheError(f"cannot listen on the socket {path}: {e.strerror or e} (a Unix "
                         f"socket's path may be at most {_SUN_PATH_MAX} bytes; this one is "
                         f"{len(os.fsencode(path))}): pass a shorter --socket") from e
    os.chmod(path, mode)  # engine pods run as other users; the hostPath dir guards access
    sock.listen(128)  # clients that connect before the event loop accepts wait in the backlog
    return sock


def _bind_tcp(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


class _Server:
    """uvicorn's server with the daemon's signal handling (built lazily: uvicorn is heavy)."""

    @staticmethod
    def create(app: FastAPI) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                # uvicorn re-raises SIGTERM after its graceful stop, killing us before the
                # builds are drained; the daemon stops on its own terms instead. A second
                # SIGTERM (handlers restored) kills at once.
                previous = {s: signal.signal(s, self.handle_exit)
                            for s in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for s, handler in previous.items():
                        signal.signal(s, handler)

        # Long-polls end within their wait_s (the CLI asks for 5 s); do not wait longer.
        return Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                     timeout_graceful_shutdown=5))


def serve(config: DaemonConfig, logger: logging.Logger, loader: ModelLoader) -> int:
    """Run until SIGTERM/SIGINT, then drain builds; returns the exit status (0 when every
    running build finished, else it exits 3 at once: the build threads cannot be joined)."""
    daemon = Daemon(config, logger, loader)
    sockets = [_bind_unix(config.socket_path, config.socket_mode)]
    tcp = None
    if config.tcp is not None:
        sockets.append(_bind_tcp(*config.tcp))
        bound_host, bound_port = sockets[-1].getsockname()[:2]
        tcp = f"{bound_host}:{bound_port}"  # the real port when asked for port 0
    metrics = None
    if config.metrics_port is not None:
        httpd, _thread = start_http_server(config.metrics_port, addr=config.metrics_address,
                                           registry=daemon.metrics.registry)
        metrics = f"{config.metrics_address}:{httpd.server_port}"
    daemon.start()
    event(logger, "daemon_started", root=str(config.root), socket=str(config.socket_path),
          tcp=tcp, metrics=metrics, pid=os.getpid(), grace_s=config.grace_s,
          scrub_interval_s=config.scrub_interval_s, scrub_rate_mib_s=config.scrub_rate_mib_s)
    try:
        _Server.create(create_app(daemon)).run(sockets=sockets)
    finally:
        # Gone from the socket first: clients fall back to building under the same lock,
        # which waits for a build of ours that is still finishing, then joins it.
        config.socket_path.unlink(missing_ok=True)
        abandoned = daemon.stop()
    if abandoned:
        event(logger, "build_abandoned", logging.ERROR, recipes=abandoned, grace_s=config.grace_s,
              note="its temp dir is removed by the next builder of the same entry")
        logging.shutdown()
        sys.stderr.flush()
        os._exit(3)  # the build threads are still running and cannot be interrupted
    event(logger, "daemon_stopped")
    return 0
