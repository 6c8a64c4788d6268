"""Engine configuration: typed, frozen option groups (``types``) and the one set of validation
rules (``rules``).

The engine CLI, the HTTP server (``--config`` YAML) and the Kubernetes operator all call
``validate`` / ``EngineConfig.from_mapping``, so a spec is judged the same way everywhere.
Callers import from here. Pure Python: importing this package must never import torch (the
operator depends on it).
"""

from __future__ import annotations

from ditserve.engine.config.judged import (
    judged as judged,
)
from ditserve.engine.config.resolved_offload import (
    ResolvedOffload as ResolvedOffload,
)
from ditserve.engine.config.rules import (
    SEQUENCE_PARALLEL_IMPL as SEQUENCE_PARALLEL_IMPL,
)
from ditserve.engine.config.rules import (
    family_sequence_parallel_problems as family_sequence_parallel_problems,
)
from ditserve.engine.config.rules import (
    format_problems as format_problems,
)
from ditserve.engine.config.rules import (
    int_at_least as int_at_least,
)
from ditserve.engine.config.rules import (
    model_family_problems as model_family_problems,
)
from ditserve.engine.config.rules import (
    number_at_least as number_at_least,
)
from ditserve.engine.config.rules import (
    offload_problems as offload_problems,
)
from ditserve.engine.config.rules import (
    problems as problems,
)
from ditserve.engine.config.rules import (
    sequence_parallel_problems as sequence_parallel_problems,
)
from ditserve.engine.config.rules import (
    step_cache_problems as step_cache_problems,
)
from ditserve.engine.config.rules import (
    validate as validate,
)
from ditserve.engine.config.runner import (
    RunnerConfig as RunnerConfig,
)
from ditserve.engine.config.types import (
    CHECKPOINT_MMAP_MODES as CHECKPOINT_MMAP_MODES,
)
from ditserve.engine.config.types import (
    COMPILE_BACKENDS as COMPILE_BACKENDS,
)
from ditserve.engine.config.types import (
    COMPRESS_MODES as COMPRESS_MODES,
)
from ditserve.engine.config.types import (
    DEQUANT_MODES as DEQUANT_MODES,
)
from ditserve.engine.config.types import (
    DLO_COMPONENTS as DLO_COMPONENTS,
)
from ditserve.engine.config.types import (
    DTYPES as DTYPES,
)
from ditserve.engine.config.types import (
    GATHER_ENGINES as GATHER_ENGINES,
)
from ditserve.engine.config.types import (
    HBM_BUDGET_AUTO as HBM_BUDGET_AUTO,
)
from ditserve.engine.config.types import (
    MODEL_FAMILIES as MODEL_FAMILIES,
)
from ditserve.engine.config.types import (
    PACKED_STRIPES as PACKED_STRIPES,
)
from ditserve.engine.config.types import (
    QUANTIZATIONS as QUANTIZATIONS,
)
from ditserve.engine.config.types import (
    SCHEDULING_POLICIES as SCHEDULING_POLICIES,
)
from ditserve.engine.config.types import (
    VAE_TILING_MODES as VAE_TILING_MODES,
)
from ditserve.engine.config.types import (
    DType as DType,
)
from ditserve.engine.config.types import (
    EngineConfig as EngineConfig,
)
from ditserve.engine.config.types import (
    OffloadConfig as OffloadConfig,
)
from ditserve.engine.config.types import (
    ParallelConfig as ParallelConfig,
)
from ditserve.engine.config.types import (
    PipelineConfig as PipelineConfig,
)
from ditserve.engine.config.types import (
    SchedulerConfig as SchedulerConfig,
)
from ditserve.engine.config.types import (
    StepCacheConfig as StepCacheConfig,
)
from ditserve.engine.config.types import (
    raise_problems as raise_problems,
)
from ditserve.engine.config.unknown_keys import (
    reject_unknown_keys as reject_unknown_keys,
)
