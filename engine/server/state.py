"""ServerState: what the routes share (engine, config, metrics) and the engine's lifecycle
as seen by the server (loading, ready, draining, stopped).

The lifespan starts the engine in a worker thread (``start_engine``) so /health answers while
weights load; the SIGTERM handler calls ``begin_drain``, waits while ``has_work``, then
``stop``; the lifespan's exit calls ``stop`` too. ``engine.shutdown`` runs exactly once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ditserve.engine.request import MAX_SIDE, MAX_STEPS
from ditserve.engine.server.config import ServerConfig, parse_size
from ditserve.engine.server.metrics import ServingMetrics
from ditserve.engine.server.model_defaults import model_defaults
from ditserve.engine.server.schemas import RequestLimits
from ditserve.engine.step_log import StepLog, copy_rates_of

log = logging.getLogger(__name__)

TINY_MODEL_NAME = "ditserve-tiny-flux"


@dataclass
class ServerState:
    engine: Any
    config: ServerConfig
    metrics: ServingMetrics
    model_name: str
    default_size: tuple[int, int]
    default_steps: int
    on_start_failed: Callable[[BaseException], None] | None = None
    startup_error: str | None = None
    draining: bool = False
    _stop_lock: threading.Lock = field(default_factory=threading.Lock)
    _stopped: bool = False

    @classmethod
    def build(cls, engine: Any, config: ServerConfig, **kwargs: Any) -> ServerState:
        model = engine.config.model
        name = config.model_name or (Path(model).name if model else TINY_MODEL_NAME)
        defaults = model_defaults(model)
        size = parse_size(config.default_size) if config.default_size else None
        size = size or (defaults.width, defaults.height)  # ServerConfig validated the pattern
        steps = config.default_steps or defaults.steps
        if engine.compile_warmup_size is None:
            width, height = size  # with --compile: no compile after /ready
            engine.compile_warmup_size = (height, width)
        metrics = ServingMetrics(lambda: engine)
        engine.observers.append(metrics)
        engine.observers.append(StepLog(copy_rates=lambda: copy_rates_of(engine.offload_report())))
        return cls(engine, config, metrics, name, size, steps, **kwargs)

    @property
    def ready(self) -> bool:
        return bool(self.engine.ready) and not self.draining and not self._stopped

    def limits(self) -> RequestLimits:
        """What a request may ask for now (the model's rules are known once it loaded)."""
        config = self.config
        return RequestLimits(
            model_name=self.model_name, default_size=self.default_size,
            default_steps=self.default_steps, pixel_multiple=self.engine.pixel_multiple,
            max_prompt_chars=self.engine.max_prompt_chars,
            max_side=min(config.max_side or MAX_SIDE, MAX_SIDE),
            max_steps=min(config.max_steps or MAX_STEPS, MAX_STEPS),
        )

    def start_engine(self) -> None:
        """Blocking; run in a thread. A failure is recorded and reported, never raised."""
        try:
            self.engine.start()
            log.info("engine ready: serving %s", self.model_name)
        except BaseException as e:
            log.exception("engine failed to start")
            # What /ready shows: the kind of failure, not its internals (those are logged).
            self.startup_error = f"the engine failed to start ({type(e).__name__}); see the log"
            if self.on_start_failed is not None:
                self.on_start_failed(e)

    def begin_drain(self) -> None:
        """Refuse new work from now on (/ready 503, new requests 503); admitted work goes on."""
        self.draining = True
        if self.engine.executor is not None:
            self.engine.stop_accepting()

    def has_work(self) -> bool:
        if self.engine.executor is None:
            return False
        stats = self.engine.stats()
        return stats.running + stats.waiting > 0

    def stop(self, grace_seconds: float = 0.0) -> None:
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        if self.engine.executor is None:  # never finished loading: nothing to drain
            return
        self.engine.shutdown(grace_seconds)
        log.info("engine stopped")
