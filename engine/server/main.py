"""`ditserve serve`: server flags, the config file's ``server:`` section, uvicorn, and the
SIGTERM drain.

Called by engine.cli (``add_server_options`` while building the parser, ``serve_from_args``
to run). Precedence: command-line flag > ``--config`` YAML > default; the API key comes from
``--api-key`` or the environment variable named by ``server.api_key_env``.

Shutdown: the first SIGTERM/SIGINT starts a drain - /ready turns 503 and new requests get
503 at once while the listener stays open, admitted requests run for up to
``shutdown_grace_s``, the rest are aborted - then uvicorn exits. A second signal ends the
grace period at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from dataclasses import replace
from types import FrameType
from typing import Any

import uvicorn

from ditserve.engine.cli_options import engine_config_and_server_section
from ditserve.engine.server.config import ServerConfig, validate_server

log = logging.getLogger(__name__)

# (flag dest) -> ServerConfig field
_SERVER_FLAGS = {
    "host": "host", "port": "port", "request_timeout": "request_timeout_s",
    "shutdown_grace": "shutdown_grace_s", "served_model_name": "model_name",
    "default_size": "default_size", "default_steps": "default_steps",
    "api_key_env": "api_key_env", "log_level": "log_level", "retry_after": "retry_after_s",
    "max_side": "max_side", "max_steps": "max_steps", "max_body_bytes": "max_body_bytes",
    "allowed_origins": "allowed_origins", "docs": "docs",
    "default_frames": "default_frames", "default_fps": "default_fps",
    "max_frames": "max_frames", "video_dir": "video_dir", "video_max_jobs": "video_max_jobs",
    "video_max_bytes": "video_max_bytes", "video_ttl": "video_ttl_s",
}


def _origins(text: str) -> tuple[str, ...]:
    return tuple(origin.strip() for origin in text.split(",") if origin.strip())


def add_server_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=None, help="port (default 8000; 0 picks one)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*; prefer the env var")
    g.add_argument("--api-key-env", default=None,
                   help="environment variable holding the API key (default DITSERVE_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds before an unfinished request is aborted (default 600)")
    g.add_argument("--shutdown-grace", type=float, default=None,
                   help="seconds admitted requests may finish after SIGTERM (default 30)")
    g.add_argument("--retry-after", type=int, default=None,
                   help="Retry-After seconds sent with 429 and 503 (default 1)")
    g.add_argument("--served-model-name", default=None,
                   help="model id in /v1/models (default: the model directory's name)")
    g.add_argument("--default-size", default=None,
                   help="size when a request omits it or sends 'auto' (default: from the "
                        "model, e.g. 64x64 for the tiny model, 1024x1024 for Flux.1)")
    g.add_argument("--default-steps", type=int, default=None,
                   help="num_inference_steps when omitted (default: from the model, e.g. 4 "
                        "for the tiny model and Flux.1-schnell, 28 for Flux.1-dev)")
    g.add_argument("--max-side", type=int, default=None,
                   help="largest width or height a request may ask for (default 8192)")
    g.add_argument("--max-steps", type=int, default=None,
                   help="largest num_inference_steps a request may ask for (default 1000)")
    g.add_argument("--max-body-bytes", type=int, default=None,
                   help="larger request bodies get 413 (default 1048576)")
    g.add_argument("--allowed-origins", type=_origins, default=None, metavar="ORIGINS",
                   help="comma-separated browser origins allowed by CORS, or '*' "
                        "(default: CORS off)")
    g.add_argument("--disable-docs", dest="docs", action="store_const", const=False,
                   default=None, help="do not serve the interactive API page at /docs")
    g.add_argument("--log-level", default=None,
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    v = parser.add_argument_group("video jobs (a video model: POST /v1/videos)")
    v.add_argument("--default-frames", type=int, default=None,
                   help="frames of a job that names neither num_frames nor seconds "
                        "(default: from the model, 81 for Wan)")
    v.add_argument("--default-fps", type=int, default=None,
                   help="the model's native frame rate: MP4 fps and the rate `seconds` "
                        "counts frames at (default 16, Wan's)")
    v.add_argument("--max-frames", type=int, default=None,
                   help="most frames a job may ask for (default 1025)")
    v.add_argument("--video-dir", default=None,
                   help="directory for finished MP4s, owned by this server (default: a "
                        "private temporary directory removed at exit)")
    v.add_argument("--video-max-jobs", type=int, default=None,
                   help="jobs held at once, any state (default 256); more get 429")
    v.add_argument("--video-max-bytes", type=int, default=None,
                   help="bytes of stored MP4s plus running jobs' reservations (default "
                        "4294967296); more get 429")
    v.add_argument("--video-ttl", type=float, default=None,
                   help="seconds a finished job and its MP4 are kept (default 3600)")


def server_config_from_args(args: argparse.Namespace, base: dict[str, Any] | None = None,
                            environ: dict[str, str] | None = None) -> ServerConfig:
    config = ServerConfig.from_mapping(base or {})
    changes = {field: getattr(args, dest) for dest, field in _SERVER_FLAGS.items()
               if getattr(args, dest, None) is not None}
    config = replace(config, **changes)
    env = os.environ if environ is None else environ
    api_key = getattr(args, "api_key", None) or env.get(config.api_key_env) or None
    return validate_server(replace(config, api_key=api_key))


def configs_from_args(args: argparse.Namespace) -> tuple[Any, ServerConfig]:
    """(EngineConfig, ServerConfig) from the flags and the optional YAML file."""
    engine_config, server_section = engine_config_and_server_section(args)
    return engine_config, server_config_from_args(args, base=server_section)


def serve_from_args(args: argparse.Namespace) -> int:
    engine_config, server_config = configs_from_args(args)
    return run_server(engine_config, server_config)


def run_server(engine_config: Any, server_config: ServerConfig) -> int:
    from ditserve.engine.loop.engine import DiffusionEngine
    from ditserve.engine.server.app import create_app
    from ditserve.engine.server.metrics import ServingMetrics
    from ditserve.engine.server.state import engine_options

    if engine_config.model is not None:
        from ditserve.engine.weights.loader import read_model_index

        read_model_index(engine_config.model)  # a wrong path fails now, not after binding

    failed: list[BaseException] = []
    server: DrainingServer | None = None

    def on_start_failed(exc: BaseException) -> None:
        failed.append(exc)
        if server is not None:
            server.should_exit = True

    engine: DiffusionEngine  # the observers below read it once it exists
    metrics = ServingMetrics(lambda: engine)
    options = engine_options(engine_config, server_config, metrics, lambda: engine)
    engine = DiffusionEngine(engine_config, **options)
    app = create_app(engine, server_config, serving_metrics=metrics,
                     on_start_failed=on_start_failed)
    uv_config = uvicorn.Config(
        app, host=server_config.host, port=server_config.port, log_level=server_config.log_level,
        lifespan="on", timeout_graceful_shutdown=5,
        # One line per request is noise at serving rates; debug/trace turn it on.
        access_log=server_config.log_level in ("debug", "trace"),
    )
    server = DrainingServer(uv_config, state=app.state.server)
    if server_config.api_key is None:
        log.info("auth is off (set %s or --api-key to require a Bearer token)",
                 server_config.api_key_env)
    server.run()
    if failed:
        log.error("the engine failed to start: %s", failed[0])
        return 1
    return 0


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the engine before exiting."""

    def __init__(self, config: Any, *, state: Any) -> None:
        super().__init__(config)
        self._state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_started = False
        self._hurry = False

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler: only flip flags and schedule work on the loop.
        if self._loop is None:
            self.should_exit = True
            return
        if self._drain_started:
            # A second signal ends the grace period now (the drain aborts what is left and
            # exits cleanly); a third one makes uvicorn skip its own graceful shutdown too.
            self.force_exit = self._hurry
            self._hurry = True
            return
        self._drain_started = True
        self._loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        # On the event loop, not in the signal handler: draining takes the engine's lock,
        # which the interrupted code may hold. /ready is 503 from this moment.
        log.info("received %s", signal.Signals(sig).name)
        self._state.begin_drain()
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        state, loop = self._state, asyncio.get_running_loop()
        grace = state.config.shutdown_grace_s
        log.info("draining: admitted requests may finish for up to %.1fs", grace)
        try:
            deadline = loop.time() + grace
            # Polled: the engine has no "idle" event, and 0.1 s is nothing next to a grace
            # period. A second signal ends the wait at once.
            while state.has_work() and loop.time() < deadline and not self._hurry:
                await asyncio.sleep(0.1)
            if state.has_work():
                log.warning("%s: aborting the requests still admitted",
                            "second signal" if self._hurry else "grace period over")
            await asyncio.to_thread(state.stop, 0.0)  # aborts what is left, stops the engine
        finally:
            self.should_exit = True
