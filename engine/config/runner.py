"""RunnerConfig: what one rank's ModelRunner runs with, cut from the replica's EngineConfig.

``EngineConfig`` is the whole replica (its model path, its DP/SP layout, its options);
``RunnerConfig`` is the part a rank's runner reads - the weights' dtype and form, the device,
its SP share, the offload as the composition root resolved it, and the scheduling, pipeline,
adapter and step-cache options the runner and its memory plan use. ``RunnerConfig.of`` makes
it from a judged config: the engine (``loop.startup``) for the ranks it starts, ``ditserve
worker`` for a launched rank, and tests and tools that build a runner on their own. Below
that cut nothing takes the root config (a test keeps ``engine/runner``, ``placement``,
``step``, ``sched`` and ``distributed`` free of it). A spawned worker receives one pickled.
Pure Python (no torch), like the rest of ``config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ditserve.engine.config.adapters import AdapterConfig
from ditserve.engine.config.resolved_offload import ResolvedOffload
from ditserve.engine.config.types import (
    CompileBackend,
    DType,
    EngineConfig,
    PipelineConfig,
    Quantization,
    SchedulerConfig,
    StepCacheConfig,
)


@dataclass(frozen=True, kw_only=True)
class RunnerConfig:
    """One rank's runner options (module docstring); each field means what the
    ``EngineConfig`` field of the same name means.

    sequence_parallel_size: the SP group this rank's forwards run with (1: no SP).
    offload: the DiT's offload, resolved once for the replica (``ResolvedOffload``).
    scheduler, pipeline: what the memory plan reads and may lower (``--dlo-hbm-budget-gib``);
        a runner's ``config`` holds them as lowered.
    """

    dtype: DType = "float32"
    device: str = "auto"
    checkpoint: str | None = None
    compile: CompileBackend | None = None
    quantization: Quantization | None = None
    sequence_parallel_size: int = 1
    offload: ResolvedOffload = field(default_factory=ResolvedOffload)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    adapters: AdapterConfig = field(default_factory=AdapterConfig)
    step_cache: StepCacheConfig = field(default_factory=StepCacheConfig)

    @classmethod
    def of(cls, config: EngineConfig, *, offload: ResolvedOffload | None = None) -> RunnerConfig:
        """The runner's part of a judged ``config``. ``offload``: its offload as the
        composition root resolved it; None resolves it here (a runner built on its own is its
        own composition root)."""
        if offload is None:
            offload = ResolvedOffload.of(config.offload, parallel=config.parallel)
        return cls(dtype=config.dtype, device=config.device, checkpoint=config.checkpoint,
                   compile=config.compile, quantization=config.quantization,
                   sequence_parallel_size=config.parallel.sequence_parallel_size,
                   offload=offload, scheduler=config.scheduler, pipeline=config.pipeline,
                   adapters=config.adapters, step_cache=config.step_cache)
