"""Engine configuration types: the typed, frozen option groups and how a mapping becomes one.

Read from the CLI, the server's ``--config`` YAML and the operator's rendered engine config;
``EngineConfig.from_mapping`` builds and then judges a config with the rules in
``config.rules`` (which register their judge here: the rules read these types). Pure Python: importing
this module must never import torch (the operator depends on it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from ditserve.engine.config.adapters import AdapterConfig
from ditserve.engine.config.step_cache import StepCacheSpec
from ditserve.engine.config.unknown_keys import Section, reject_unknown_keys
from ditserve.engine.errors import ConfigError
from ditserve.engine.families import AUTO_FAMILY, family_labels

DType = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(DType)
CheckpointMmap = Literal["auto", "off"]
CHECKPOINT_MMAP_MODES: tuple[str, ...] = get_args(CheckpointMmap)
GatherEngine = Literal["nccl", "copy-engine"]
GATHER_ENGINES: tuple[str, ...] = get_args(GatherEngine)
# torch.compile backends for the DiT's repeated blocks: inductor generates kernels; aot_eager
# and eager only trace (for checking a model compiles, and in tests on machines without a
# C++ compiler).
CompileBackend = Literal["inductor", "aot_eager", "eager"]
COMPILE_BACKENDS: tuple[str, ...] = get_args(CompileBackend)
# The values a deployment's ``model.family`` may take: Auto (read model_index.json) or a
# registered family (engine/families/); the operator judges specs with the rule below.
MODEL_FAMILIES: tuple[str, ...] = (AUTO_FAMILY, *family_labels())
# Host weight formats (docs/formats.md): how streamed blocks' bf16 bytes sit in host memory,
# and which linear layers run in FP8. ``format_problems`` says what each combines with.
CompressMode = Literal["none", "lossless"]
COMPRESS_MODES: tuple[str, ...] = get_args(CompressMode)
# Where a GGUF DiT's streamed layers dequantize under DLO: at each call on the compute stream,
# or into a bf16 slot region on the offload's decode stream (engine.offload.slot_dequant).
DequantMode = Literal["compute", "slot"]
DEQUANT_MODES: tuple[str, ...] = get_args(DequantMode)
Quantization = Literal["fp8"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
# An AllGather group splits each packed bf16 run by whole stripes, so its size must divide
# the stripe count the offload packs with: engine.formats.packed_layout.DEFAULT_STRIPES (a
# test keeps the two equal; that module refers to torch, which this one must not import).
PACKED_STRIPES = 8


@dataclass(frozen=True)
class OffloadConfig:
    """Distributed layerwise offload (DLO) settings.

    enabled: stream the DiT's blocks from host memory through device slots.
    slots: device slots blocks stream through (>= 2); None picks 2 for rank-local streaming
        and 8 for AllGather. Two overlap one block's copy with the previous block's compute;
        more let copies run ahead where some blocks compute longer than they copy
        (AllGather's single blocks), at one largest block of HBM per slot.
    use_allgather: with a DP/SP group of size > 1, each rank keeps 1/group of every block and
        rebuilds it with all_gather; no effect at group size 1.
    gather: how AllGather rebuilds a block: "nccl" (all_gather kernels) or "copy-engine"
        (peer-to-peer DMA through CUDA symmetric memory: no SMs taken from compute).
    resident_layers: leading blocks kept on the device (not streamed).
    hbm_budget_gib: the HBM the whole pipeline may use, in GiB, or "auto" (the device's free
        HBM at start): DiT slots and resident blocks, text encoders, VAE and its decode,
        a step's activations and the allocator's slack; blocks stay resident while they fit
        (engine.placement.budget_plan; the engine refuses to start under the smallest budget
        it can meet, and says which).
    runtime_cache: use the node cache (cachectl) entry as the host backing.
    cache_root: root of the node cache; None means $DITSERVE_CACHE_ROOT or the default.
    cache_lock_timeout_s: how long to wait for another process building the same entry.
    pin_limit_gib: host-registration budget for mmap backings; 0 uses bounded staging slots.
    checkpoint_mmap: "auto" streams straight from the checkpoint's safetensors when it can.
    compress: "lossless" keeps the streamed blocks' bf16 regions packed (12-bit, bit-exact) in
        host memory and decodes them on the device after each copy; "none" streams raw bytes.
    dequant: where a GGUF DiT's streamed layers dequantize: "compute" (each layer, at each
        call, on the compute stream) or "slot" (the offload's decode stream dequantizes each
        block into a bf16 region of its slot after the copy; the layers run plain linears
        over it, bit-identical; each slot grows by the largest block's bf16 GGUF weights).
    components: what DLO governs besides streaming the DiT: "all" also parks the text
        encoders in (pinned) host memory, on the device only for an encode pass; "dit"
        keeps them resident (docs/offload.md, "Whole pipeline").
    """

    enabled: bool = False
    slots: int | None = None
    use_allgather: bool = True
    gather: GatherEngine = "nccl"
    resident_layers: int = 0
    hbm_budget_gib: float | str | None = None
    runtime_cache: bool = False
    cache_root: str | None = None
    cache_lock_timeout_s: float = 600.0
    pin_limit_gib: float = 0.0
    checkpoint_mmap: CheckpointMmap = "auto"
    compress: CompressMode = "none"
    dequant: DequantMode = "compute"
    components: DloComponents = "all"


DloComponents = Literal["all", "dit"]
DLO_COMPONENTS: tuple[str, ...] = get_args(DloComponents)
HBM_BUDGET_AUTO = "auto"  # offload.hbm_budget_gib: the device's free HBM
VaeTilingMode = Literal["auto", "on", "off"]
VAE_TILING_MODES: tuple[str, ...] = get_args(VaeTilingMode)


@dataclass(frozen=True)
class PipelineConfig:
    """The pipeline's parts around the DiT (docs/offload.md, "Whole pipeline").

    prompt_cache_size: prompt embeddings kept (LRU) so repeated prompts and the empty negative
        prompt are encoded once; 0 disables the cache.
    prompt_cache_gib: the most device memory the cached embeddings may take.
    vae_tiling: "on" decodes in tiles/slices (diffusers' enable_tiling/enable_slicing), "off"
        decodes whole, "auto" tiles under DLO when the decoded frame is large (an image of
        at least 1024x1024 pixels, a video frame above 480p).
    """

    prompt_cache_size: int = 256
    prompt_cache_gib: float = 1.0
    vae_tiling: VaeTilingMode = "auto"


@dataclass(frozen=True)
class ParallelConfig:
    """Process topology of one engine replica (one process per accelerator).

    data_parallel_size: ranks with their own continuous batch. sequence_parallel_size:
    processes per DP rank that split each forward's tokens (Ulysses; the DiTs' head counts
    must divide by it: ``sequence_parallel_problems``)."""

    data_parallel_size: int = 1
    sequence_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.sequence_parallel_size

    @property
    def weight_group(self) -> str | None:
        """The group DLO's AllGather shards over: DP if dp > 1, else SP if sp > 1, never TP."""
        if self.data_parallel_size > 1:
            return "dp"
        if self.sequence_parallel_size > 1:
            return "sp"
        return None

    @property
    def weight_group_size(self) -> int:
        """How many ranks share the AllGather shards (1: no weight group)."""
        if self.weight_group == "dp":
            return self.data_parallel_size
        return self.sequence_parallel_size if self.weight_group == "sp" else 1


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching and admission.

    max_batch_tokens: the work budget of one step, in rows x latent tokens summed over its
        requests of every shape (``engine.sched.work``; a 1024x1024 Flux or Qwen-Image image is
        4096 tokens per row, a true-CFG request has twice its images' rows). None (the
        default): ``max_num_seqs`` requests of the served family's usual size
        (``Family.reference_work``: 16384 for four 1024x1024 Flux or Qwen-Image images,
        262080 for four 81-frame Wan videos with CFG), resolved when the engine is built. A
        request larger than the budget runs alone.
    max_request_tokens: the most work (rows x latent tokens) one request may bring to a step;
        a larger request is refused up front (400 naming ``size``). None (the default): four
        times the resolved ``max_batch_tokens`` - a step cannot be interrupted, and one huge
        request would otherwise hold the replica for one step of minutes that an abort (a
        client gone) cannot cut short. Raise it to serve larger
        images or videos (each then runs alone, in long steps).
    max_num_seqs: the most requests in one step (of any shapes), whatever their work.
    max_bypass: how often requests that fit the step may overtake an older request that does
        not, before nobody passes it (bounded wait, no starvation); 0 admits strictly in
        arrival order (FIFO, with head-of-line blocking).
    max_queue: waiting requests beyond which new ones are refused (None: unbounded), counted
        over the whole replica.
    scheduling_policy: "fcfs" admits in arrival order (with the bounded bypass) and ignores
        requests' ``priority``; "priority" admits by (priority, deadline, arrival) with aging, and
        pauses lower-priority running requests at a step boundary to make room
        (``engine.sched.policy``). Deadlines are kept under both.
    aging_s: under "priority", every ``aging_s`` seconds a request waits (or is paused) it
        counts one priority level sooner, so low priority is never starved.
    max_preemptions: the most times one request may be paused.
    urgent_companions: under "priority", the most rows of other requests (of priority 0 or
        worse) a step holds beside an urgent request (priority below 0): an urgent request
        runs nearly alone, at close to its idle latency, and the batch fills again when it
        ends. Running companions beyond it are paused when it is admitted (as far as
        ``max_preemptions`` allows). None (the default): unbounded - urgent requests only
        go first.
    plan_at: how far through its DiT blocks the running step must be on the GPU before the
        loop plans the next step (``engine.runner.plan_point``). 0 (the default): as soon as
        it starts, so a request arriving during step N first runs in step N+2; 0.8: one
        arriving in the first 80% of step N joins step N+1, if the host can plan and queue
        a step within the last 20% of one. CUDA only.

    The bound on a step's distinct LoRA adapters is not a scheduler option: it is
    ``adapters.max_loras`` (``--max-loras``), which the engine hands the resolved scheduling.
    """

    max_num_seqs: int = 4
    max_batch_tokens: int | None = None
    max_request_tokens: int | None = None
    max_bypass: int = 8
    max_queue: int | None = 64
    scheduling_policy: SchedulingPolicy = "fcfs"
    aging_s: float = 30.0
    max_preemptions: int = 2
    urgent_companions: int | None = None
    plan_at: float = 0.0


@dataclass(frozen=True)
class StepCacheConfig:
    """The server's default step cache (docs/step_cache.md); a request may override it.

    policy: first-block, teacache or every (None: off). threshold: first-block's and
    teacache's knob (None: the policy's published default). every: the ``every`` policy's K.
    """

    policy: str | None = None
    threshold: float | None = None
    every: int | None = None

    def spec(self) -> StepCacheSpec | None:
        if self.policy is None:
            return None
        return StepCacheSpec(self.policy, self.threshold, self.every)


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine replica needs. ``model`` None means the embedded tiny model.

    compile: a torch.compile backend for the DiT's repeated blocks (regional compilation,
    ``ditserve.engine.runner.compiled_blocks``); None runs them eagerly.
    quantization: "fp8" runs the DiT blocks' linear layers in FP8 e4m3 (rowwise weight scales,
    per-token activation scales; ``ditserve.engine.weights.quantize``); None keeps ``dtype``.
    checkpoint: a DiT checkpoint file (single-file safetensors, GGUF, or FP8 safetensors;
    ``ditserve.engine.weights.dit_file``) whose weights are served in place of ``model``'s DiT;
    ``model`` is then the base diffusers directory giving the DiT's config and every other
    component. The CLI's ``--model FILE --base-model DIR`` sets both.
    """

    model: str | None = None
    checkpoint: str | None = None
    dtype: DType = "float32"
    device: str = "auto"
    compile: CompileBackend | None = None
    quantization: Quantization | None = None
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    adapters: AdapterConfig = field(default_factory=AdapterConfig)
    step_cache: StepCacheConfig = field(default_factory=StepCacheConfig)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> EngineConfig:
        """Build from nested plain data (YAML, a CRD spec); unknown keys are an error.

        Nested groups are ``offload``, ``parallel``, ``scheduler``, ``adapters``,
        ``step_cache`` and ``pipeline``. The result is validated.
        """
        config = _build(cls, data, path="")
        assert _judge is not None, "config.rules registers the judge when the package loads"
        _judge(config)
        return config

    def to_mapping(self) -> dict[str, Any]:
        """Plain nested data that ``from_mapping`` reads back to an equal config."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


# The rules (config.rules) judge a built config. They read these types, so rather than import
# them back, the rules module registers its judge here on import; the package's __init__
# imports it, and importing any module of the package runs that __init__ first.
_judge: Callable[[EngineConfig], EngineConfig] | None = None


def use_judge(judge: Callable[[EngineConfig], EngineConfig]) -> None:
    """Called once by ``config.rules``: ``from_mapping`` validates with ``judge``."""
    global _judge
    _judge = judge


_NESTED = {"offload": OffloadConfig, "parallel": ParallelConfig, "scheduler": SchedulerConfig,
           "adapters": AdapterConfig, "step_cache": StepCacheConfig,
           "pipeline": PipelineConfig}
# Options that were removed, with what replaces them: a config file that still sets one is
# told how to update it rather than only that the key is unknown.
_REMOVED = {
    "scheduler.policy": "fifo admission is max_bypass: 0; bypass (the old default) is any "
                        "max_bypass > 0 (priorities: scheduling_policy)",
    "scheduler.max_loras": "the bound on a step's distinct adapters is adapters.max_loras "
                           "(--max-loras), which the scheduler follows",
    "parallel.tensor_parallel_size": "tensor parallelism is not supported; use "
                                     "data_parallel_size (throughput) or "
                                     "sequence_parallel_size (latency)",
}
SchedulingPolicy = Literal["fcfs", "priority"]
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)


def option_sections(data: Mapping[str, Any]) -> list[Section]:
    """An engine config mapping's sections with the keys each may hold (removed options too:
    building one tells how to update it), for ``reject_unknown_sections``."""
    def known(cls: type, path: str) -> set[str]:
        removed = {k.split(".", 1)[1] for k in _REMOVED if k.split(".", 1)[0] == path}
        return {f.name for f in fields(cls)} | removed
    return [(data, known(EngineConfig, ""), ""), *[(data[key], known(cls, key), key)
            for key, cls in _NESTED.items() if isinstance(data.get(key), Mapping)]]


def raise_problems(what: str, found: list[str]) -> None:
    """Raise one ConfigError listing every problem of a ``what`` configuration, if any."""
    if found:
        raise ConfigError(f"invalid {what} configuration:\n  - " + "\n  - ".join(found))


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    for key in data if isinstance(data, Mapping) else ():
        hint = _REMOVED.get(f"{path}.{key}")
        if hint is not None:
            raise ConfigError(f"{path}.{key} was removed: {hint}")
    reject_unknown_keys(data, {f.name for f in fields(cls)}, path)
    values: dict[str, Any] = {}
    for key, value in data.items():
        if cls is EngineConfig and key in _NESTED:
            values[key] = _build(_NESTED[key], value or {}, path=key)
        else:
            values[key] = value
    return cls(**values)


