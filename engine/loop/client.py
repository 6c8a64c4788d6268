"""EngineClient: the one typed seam between the HTTP server and the engine.

The server (``server.state.ServerState``, the routes, the probes, the video jobs) holds an
``EngineClient`` and reads nothing else of the engine: never its executor, runner or
pipeline. ``DiffusionEngine`` implements it; so does the tests' fake engine.

- lifecycle: ``phase`` (the engine's own ``EnginePhase``; the server keeps no copy of it),
  ``failure``, ``start``, ``drain``, ``shutdown``;
- work: ``add_request`` (validate and enqueue, a ``RequestHandle`` back), ``abort``,
  ``validate_params``, ``stats``, ``offload_report``;
- facts: ``facts()`` - what the loaded model and its device are (``EngineFacts``: the
  model's ``ModelLimits``, device, dtype, served adapters), None until the model has loaded;
  ``config``, the validated ``EngineConfig`` the engine was built from;
- adapters: ``adapters`` (the LoRA catalog the request fields and the adapter routes use) and
  ``adapter_stats`` (for /metrics).

Pure Python: importing it loads neither torch nor fastapi (an import-linter contract).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ditserve.engine.loop.lifecycle import EnginePhase
from ditserve.engine.request import ModelLimits, SamplingParams

if TYPE_CHECKING:
    from ditserve.engine.adapters.catalog import AdapterCatalog
    from ditserve.engine.config import EngineConfig
    from ditserve.engine.loop.results import EngineStats, RequestEvent, RequestHandle

__all__ = ["EngineClient", "EngineFacts", "EnginePhase", "ModelLimits"]


@dataclass(frozen=True)
class EngineFacts:
    """What a loaded engine serves: the model's limits and where it runs.

    device: the torch device of rank 0 ("cuda:0", "cpu"); dtype: the DiT's runtime dtype
    name ("bfloat16"); adapters: the names of the LoRA adapters loaded when it was asked.
    """

    limits: ModelLimits
    device: str
    dtype: str
    adapters: tuple[str, ...] = field(default_factory=tuple)


@runtime_checkable
class EngineClient(Protocol):
    """What the server may ask of an engine (see the module docstring)."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def phase(self) -> EnginePhase: ...

    @property
    def failure(self) -> str | None:
        """Why the engine is FAILED, else None."""

    def facts(self) -> EngineFacts | None:
        """The loaded model's facts; None before it loaded (or when it failed to)."""

    def start(self) -> Any:
        """Load and warm up (blocking), then admit requests; raises when that fails."""

    def drain(self) -> None: ...

    def shutdown(self, grace_seconds: float = 0.0) -> None: ...

    def validate_params(self, params: SamplingParams) -> SamplingParams:
        """Raise InvalidRequestError naming the first field the loaded model cannot run."""

    def add_request(self, params: SamplingParams, *, request_id: str | None = None,
               on_event: Callable[[RequestEvent], None] | None = None) -> RequestHandle:
        """Validate and enqueue; raises InvalidRequestError, QueueFullError or
        EngineStoppedError. ``on_event`` is called from the engine's threads."""

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Abort a pending request (its batch slot frees at the next step); False if it is
        no longer pending."""

    def stats(self) -> EngineStats: ...

    def offload_report(self) -> dict[str, Any] | None: ...

    def start_report(self) -> dict[str, Any]:
        """``{"phases": {name: seconds}, "start_to_ready_s": seconds or None}``: where this
        replica's start went (``runner.start_phases``)."""

    def pipeline_report(self) -> dict[str, Any] | None:
        """Rank 0's whole-pipeline plan and prompt-cache counters (None before it loads)."""

    @property
    def step_cache_policies(self) -> tuple[str, ...]:
        """The step-cache policies the served model takes (all of them before it loads)."""

    @property
    def adapters(self) -> AdapterCatalog | None:
        """The served LoRA adapters by name (resolve, load, unload); None before loading."""

    def adapter_stats(self) -> dict[str, int]:
        """``loaded`` adapters, and rank 0's ``resident`` adapters and their ``bytes``."""
