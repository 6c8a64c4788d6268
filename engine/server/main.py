"""`ditserve serve`: server flags, the config file's ``server:`` section, uvicorn, and the
SIGTERM drain.

Called by engine.cli.main (``add_server_options`` while building the parser, ``serve_from_args``
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
import signal
from collections.abc import Callable
from dataclasses import fields
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from ditserve.engine.config.flags import engine_config_and_server_section
from ditserve.engine.server.config import ServerConfig

# The flags and their reading live in the pure ``options`` module (the operator judges
# engine.args with them without importing uvicorn); re-exported for the CLI.
from ditserve.engine.server.options import add_server_options, server_config_from_args
from ditserve.engine.termination import record_fatal

if TYPE_CHECKING:
    from ditserve.engine.loop.engine import DiffusionEngine

log = logging.getLogger(__name__)
__all__ = ["add_server_options", "build_server", "configs_from_args", "run_server",
           "serve_from_args", "server_config_from_args"]


def configs_from_args(args: argparse.Namespace) -> tuple[Any, ServerConfig]:
    """(EngineConfig, ServerConfig) from the flags and the optional YAML file."""
    engine_config, server_section = engine_config_and_server_section(
        args, server_options={f.name for f in fields(ServerConfig)})
    return engine_config, server_config_from_args(args, base=server_section)


def serve_from_args(args: argparse.Namespace) -> int:
    engine_config, server_config = configs_from_args(args)
    return run_server(engine_config, server_config)


def run_server(engine_config: Any, server_config: ServerConfig) -> int:
    from ditserve.engine.loop.startup import import_model_libraries

    failed: list[BaseException] = []
    server, engine = build_server(engine_config, server_config, on_start_failed=failed.append)
    if server_config.api_key is None:
        log.info("auth is off (set %s or --api-key to require a Bearer token)",
                 server_config.api_key_env)
    # Here on the main thread, not on the engine's worker thread once the server listens:
    # there the same imports cost more CPU time, which delays ready (issue 50).
    import_model_libraries(engine_config.model, engine.start_timeline)
    server.run()
    if failed:
        log.error("the engine failed to start: %s", failed[0])
        record_fatal(f"the engine failed to start: {failed[0]}")
        return 1
    return 0


def build_server(engine_config: Any, server_config: ServerConfig, *,
                 on_start_failed: Callable[[BaseException], None]
                 ) -> tuple[DrainingServer, DiffusionEngine]:
    """The engine (not started: the app's lifespan starts it once the server listens), its
    app and the server around them. The model's libraries (diffusers, transformers) are not
    imported for them: the engine imports them in its start phase ``imports``
    (``loop.startup.import_model_libraries``)."""
    from ditserve.engine.loop.engine import DiffusionEngine
    from ditserve.engine.server.app import create_app
    from ditserve.engine.server.metrics import ServingMetrics
    from ditserve.engine.server.protocol import APIErrorH11Protocol
    from ditserve.engine.server.state import engine_options

    if engine_config.model is not None:
        from ditserve.engine.weights.loader import read_model_index

        read_model_index(engine_config.model)  # a wrong path fails now, not after binding

    server: DrainingServer | None = None

    def start_failed(exc: BaseException) -> None:
        on_start_failed(exc)
        if server is not None:
            server.should_exit = True

    engine: DiffusionEngine  # the observers below read it once it exists
    metrics = ServingMetrics(lambda: engine)
    options = engine_options(engine_config, server_config, metrics, lambda: engine)
    engine = DiffusionEngine(engine_config, **options)
    app = create_app(engine, server_config, serving_metrics=metrics,
                     on_start_failed=start_failed)
    uv_config = uvicorn.Config(
        app, host=server_config.host, port=server_config.port, log_level=server_config.log_level,
        lifespan="on", timeout_graceful_shutdown=5, http=APIErrorH11Protocol,
        # One line per request is noise at serving rates; debug/trace turn it on.
        access_log=server_config.log_level in ("debug", "trace"),
    )
    server = DrainingServer(uv_config, state=app.state.server)
    return server, engine


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
