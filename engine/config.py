"""Engine configuration: typed, frozen option groups and the one set of validation rules.

Owns every rule about which option values and combinations are rejected. The engine CLI,
the HTTP server (``--config`` YAML) and the Kubernetes operator all call ``validate`` /
``EngineConfig.from_mapping`` so a spec is judged the same way everywhere. Pure Python:
importing this module must never import torch (the operator depends on it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from ditserve.engine.adapters.config import AdapterConfig, adapter_problems
from ditserve.engine.errors import ConfigError, InvalidRequestError
from ditserve.engine.families import AUTO_FAMILY, family_labels, family_named
from ditserve.engine.step_cache.spec import POLICIES as STEP_CACHE_POLICIES
from ditserve.engine.step_cache.spec import StepCacheSpec

DType = Literal["float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
CHECKPOINT_MMAP_MODES: tuple[str, ...] = ("auto", "off")
GATHER_ENGINES: tuple[str, ...] = ("nccl", "copy-engine")
# torch.compile backends for the DiT's repeated blocks: inductor generates kernels; aot_eager
# and eager only trace (for checking a model compiles, and in tests on machines without a
# C++ compiler).
COMPILE_BACKENDS: tuple[str, ...] = ("inductor", "aot_eager", "eager")
# The values a deployment's ``model.family`` may take: Auto (read model_index.json) or a
# registered family (engine/families/); the operator judges specs with the rule below.
MODEL_FAMILIES: tuple[str, ...] = (AUTO_FAMILY, *family_labels())
# Host weight formats (docs/formats.md): how streamed blocks' bf16 bytes sit in host memory,
# and which linear layers run in FP8. ``format_problems`` says what each combines with.
COMPRESS_MODES: tuple[str, ...] = ("none", "lossless")
QUANTIZATIONS: tuple[str, ...] = ("fp8",)
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
    hbm_budget_gib: keep as many blocks resident as fit in this budget; stream the rest.
    runtime_cache: use the node cache (cachectl) entry as the host backing.
    cache_root: root of the node cache; None means $DITSERVE_CACHE_ROOT or the default.
    cache_lock_timeout_s: how long to wait for another process building the same entry.
    pin_limit_gib: host-registration budget for mmap backings; 0 uses bounded staging slots.
    checkpoint_mmap: "auto" streams straight from the checkpoint's safetensors when it can.
    compress: "lossless" keeps the streamed blocks' bf16 regions packed (12-bit, bit-exact) in
        host memory and decodes them on the device after each copy; "none" streams raw bytes.
    components: what DLO governs besides streaming the DiT: "all" also parks the text
        encoders in (pinned) host memory, on the device only for an encode pass; "dit"
        keeps them resident (docs/offload.md, "Whole pipeline").
    """

    enabled: bool = False
    slots: int | None = None
    use_allgather: bool = True
    gather: str = "nccl"
    resident_layers: int = 0
    hbm_budget_gib: float | None = None
    runtime_cache: bool = False
    cache_root: str | None = None
    cache_lock_timeout_s: float = 600.0
    pin_limit_gib: float = 0.0
    checkpoint_mmap: str = "auto"
    compress: str = "none"
    components: str = "all"


DLO_COMPONENTS: tuple[str, ...] = ("all", "dit")
VAE_TILING_MODES: tuple[str, ...] = ("auto", "on", "off")


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
    vae_tiling: str = "auto"


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
        requests of every shape (``engine.work``; a 1024x1024 Flux or Qwen-Image image is
        4096 tokens per row, a true-CFG request has twice its images' rows). None (the
        default): ``max_num_seqs`` requests of the served family's usual size
        (``Family.reference_work``: 16384 for four 1024x1024 Flux or Qwen-Image images,
        262080 for four 81-frame Wan videos with CFG), resolved when the engine is built. A
        request larger than the budget runs alone.
    max_num_seqs: the most requests in one step (of any shapes), whatever their work.
    max_bypass: how often requests that fit the step may overtake an older request that does
        not, before nobody passes it (bounded wait, no starvation); 0 admits strictly in
        arrival order (FIFO, with head-of-line blocking).
    max_queue: waiting requests beyond which new ones are refused (None: unbounded), counted
        over the whole replica.
    scheduling_policy: "fcfs" admits in arrival order (with the bounded bypass) and ignores
        requests' ``priority``; "priority" admits by (priority, deadline, arrival) with aging, and
        pauses lower-priority running requests at a step boundary to make room
        (``engine.scheduling_policy``). Deadlines are kept under both.
    aging_s: under "priority", every ``aging_s`` seconds a request waits (or is paused) it
        counts one priority level sooner, so low priority is never starved.
    max_preemptions: the most times one request may be paused.
    """

    max_num_seqs: int = 4
    max_batch_tokens: int | None = None
    max_bypass: int = 8
    max_queue: int | None = 64
    scheduling_policy: str = "fcfs"
    aging_s: float = 30.0
    max_preemptions: int = 2


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
    """

    model: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    compile: str | None = None
    quantization: str | None = None
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
        validate(config)
        return config

    def to_mapping(self) -> dict[str, Any]:
        """Plain nested data that ``from_mapping`` reads back to an equal config."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


_NESTED = {"offload": OffloadConfig, "parallel": ParallelConfig, "scheduler": SchedulerConfig,
           "adapters": AdapterConfig, "step_cache": StepCacheConfig,
           "pipeline": PipelineConfig}
# Options that were removed, with what replaces them: a config file that still sets one is
# told how to update it rather than only that the key is unknown.
_REMOVED = {
    "scheduler.policy": "fifo admission is max_bypass: 0; bypass (the old default) is any "
                        "max_bypass > 0 (priorities: scheduling_policy)",
    "parallel.tensor_parallel_size": "tensor parallelism is not supported; use "
                                     "data_parallel_size (throughput) or "
                                     "sequence_parallel_size (latency)",
}
SCHEDULING_POLICIES = ("fcfs", "priority")


def reject_unknown_keys(data: Any, known: set[str], path: str = "") -> None:
    """A config mapping may only hold ``known`` keys; the error names the others."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - known)
    if unknown:
        where = f" in {path}" if path else ""
        raise ConfigError(
            f"unknown option(s){where}: {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )


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


def int_at_least(problems: list[str], name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        problems.append(f"{name} must be an integer >= {minimum}, got {value!r}")


def number_at_least(problems: list[str], name: str, value: Any, minimum: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < minimum:
        problems.append(f"{name} must be a number >= {minimum}, got {value!r}")


def problems(config: EngineConfig) -> list[str]:
    """Every rule the config breaks, each as a message that says how to fix it."""
    out: list[str] = []
    if config.dtype not in DTYPES:
        out.append(f"dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
    if not isinstance(config.device, str) or not (
        config.device in ("auto", "cpu", "cuda") or config.device.startswith("cuda:")
    ):
        out.append(f"device must be auto, cpu, cuda or cuda:N, got {config.device!r}")
    if config.compile is not None and config.compile not in COMPILE_BACKENDS:
        out.append(f"compile must be one of {', '.join(COMPILE_BACKENDS)} (or unset), "
                   f"got {config.compile!r}")

    par = config.parallel
    int_at_least(out, "parallel.data_parallel_size", par.data_parallel_size, 1)
    int_at_least(out, "parallel.sequence_parallel_size", par.sequence_parallel_size, 1)

    sch = config.scheduler
    int_at_least(out, "scheduler.max_num_seqs", sch.max_num_seqs, 1)
    if sch.max_batch_tokens is not None:
        int_at_least(out, "scheduler.max_batch_tokens", sch.max_batch_tokens, 1)
    int_at_least(out, "scheduler.max_bypass", sch.max_bypass, 0)
    if sch.max_queue is not None:
        int_at_least(out, "scheduler.max_queue", sch.max_queue, 0)
    if sch.scheduling_policy not in SCHEDULING_POLICIES:
        out.append(f"scheduler.scheduling_policy must be one of "
                   f"{', '.join(SCHEDULING_POLICIES)}, got {sch.scheduling_policy!r}")
    number_at_least(out, "scheduler.aging_s", sch.aging_s, 0.001)
    int_at_least(out, "scheduler.max_preemptions", sch.max_preemptions, 0)

    pipe = config.pipeline
    int_at_least(out, "pipeline.prompt_cache_size", pipe.prompt_cache_size, 0)
    number_at_least(out, "pipeline.prompt_cache_gib", pipe.prompt_cache_gib, 0)
    if pipe.vae_tiling not in VAE_TILING_MODES:
        out.append(f"pipeline.vae_tiling must be one of {', '.join(VAE_TILING_MODES)}, "
                   f"got {pipe.vae_tiling!r}")

    out.extend(adapter_problems(config.adapters))
    if config.adapters.lora_modules and config.compile is not None and not config.adapters.fuse:
        out.append("adapters are applied by hooks around the DiT's linear layers, which "
                   "--compile does not trace; drop --compile, or serve one adapter fused "
                   "(--lora-fuse)")
    out.extend(step_cache_problems(config.step_cache, parallel=par))
    off = config.offload
    if off.components not in DLO_COMPONENTS:
        out.append(f"offload.components must be one of {', '.join(DLO_COMPONENTS)}, "
                   f"got {off.components!r}")
    out.extend(offload_problems(off, parallel=par))
    group = par.weight_group_size if off.enabled and off.use_allgather else 1
    out.extend(format_problems(off, quantization=config.quantization, dtype=config.dtype,
                               group_size=group))
    return out


def format_problems(
    off: OffloadConfig,
    *,
    quantization: str | None = None,
    dtype: str | None = None,
    group_size: int = 1,
) -> list[str]:
    """What the host weight formats combine with, in one place (docs/formats.md).

    ==================  ========  =====  =============  =============  ===============  =======
    format              resident  DLO    DLO AllGather  runtime cache  checkpoint mmap  compile
    ==================  ========  =====  =============  =============  ===============  =======
    lossless (bf16)     no        yes    group | 8      no             read at enable   yes
    fp8                 yes       yes    yes            no             no (private)     yes
    lossless + fp8      no
    ==================  ========  =====  =============  =============  ===============  =======

    - lossless packs bf16 only (``dtype`` bfloat16); other dtype regions of a block stream raw.
      An AllGather group splits every packed run by whole stripes (``PACKED_STRIPES``).
    - "read at enable": the packed slabs are private, so a mapped checkpoint is only read
      once to fill them (``checkpoint_mmap`` auto); ``pin_limit_gib`` (registering the mapping)
      and the runtime cache (sharing raw pages; its v1 manifest carries no packed layout and
      no quantization rule) do not apply.
    - fp8 replaces the linears' weights by new fp8/fp32 tensors after loading, so the DiT is
      loaded privately (no checkpoint mapping) and the runtime cache v1 is refused.
    - fp8 + lossless: after FP8 there is little bf16 left to pack, and FP8 bytes pack poorly.

    ``quantization`` / ``dtype`` None: not known here (the offload backend checks at enable
    what it can: the group's size); those rules are skipped.
    """
    out: list[str] = []
    if off.compress not in COMPRESS_MODES:
        out.append(f"offload.compress must be one of {', '.join(COMPRESS_MODES)}, "
                   f"got {off.compress!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        out.append(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset), "
                   f"got {quantization!r}")
    lossless = off.compress == "lossless"
    if lossless and not off.enabled:
        out.append("offload.compress=lossless packs the streamed blocks' host bytes; it needs "
                   "offload.enabled (--offload dlo), or drop --dlo-compress")
    if lossless and dtype is not None and dtype != "bfloat16":
        out.append(f"offload.compress=lossless packs bfloat16 weights, but dtype is {dtype}; "
                   "set dtype bfloat16 (--dtype bfloat16) or drop --dlo-compress")
    if lossless and group_size > 1 and PACKED_STRIPES % group_size:
        out.append(f"offload.compress=lossless splits each packed run into {PACKED_STRIPES} "
                   f"stripes, which an AllGather group of {group_size} cannot share evenly; use "
                   f"a group size dividing {PACKED_STRIPES}, --dlo-no-use-allgather, or drop "
                   "--dlo-compress")
    if lossless and off.runtime_cache:
        out.append("offload.compress=lossless keeps private packed slabs; the runtime cache "
                   "(v1) shares raw bf16 pages and has no packed entries: drop one of "
                   "--dlo-compress and --dlo-runtime-cache")
    if lossless and off.pin_limit_gib:
        out.append("offload.pin_limit_gib registers mapped weights in place, but lossless "
                   "packing copies them into private pinned slabs; set it to 0 or drop "
                   "--dlo-compress")
    if quantization == "fp8" and lossless:
        out.append("quantization=fp8 and offload.compress=lossless do not combine (FP8 leaves "
                   "little bf16 to pack, and FP8 bytes pack poorly): choose one")
    if quantization == "fp8" and off.enabled and off.runtime_cache:
        out.append("quantization=fp8 changes the DiT's tensors, which the runtime cache v1 "
                   "neither stores nor keys on: drop --dlo-runtime-cache or --quantization")
    return out


def offload_problems(
    off: OffloadConfig, *, parallel: ParallelConfig | None = None, allgather: bool | None = None
) -> list[str]:
    """The DLO rules, alone. ``allgather``: whether blocks are sharded over a group; None
    derives it from ``parallel`` (the offload backend, which holds the group, passes it when
    it asserts these rules at its boundary)."""
    out: list[str] = []
    par = parallel or ParallelConfig()
    int_at_least(out, "offload.resident_layers", off.resident_layers, 0)
    if off.slots is not None:
        int_at_least(out, "offload.slots", off.slots, 2)
    if off.hbm_budget_gib is not None:
        number_at_least(out, "offload.hbm_budget_gib", off.hbm_budget_gib, 0)
    number_at_least(out, "offload.pin_limit_gib", off.pin_limit_gib, 0)
    number_at_least(out, "offload.cache_lock_timeout_s", off.cache_lock_timeout_s, 0)
    if off.gather not in GATHER_ENGINES:
        out.append(f"offload.gather must be one of {', '.join(GATHER_ENGINES)}, got {off.gather!r}")
    if off.checkpoint_mmap not in CHECKPOINT_MMAP_MODES:
        out.append(
            f"offload.checkpoint_mmap must be one of {', '.join(CHECKPOINT_MMAP_MODES)}, "
            f"got {off.checkpoint_mmap!r}"
        )
    if not off.enabled:
        touched = [
            name
            for name, value in (
                ("slots", off.slots is not None),
                ("resident_layers", off.resident_layers != 0),
                ("hbm_budget_gib", off.hbm_budget_gib is not None),
                ("runtime_cache", off.runtime_cache),
                ("pin_limit_gib", off.pin_limit_gib != 0),
            )
            if value
        ]
        if touched:
            out.append(
                f"offload.{', offload.'.join(touched)} only apply with offload enabled; "
                "set offload.enabled (--offload dlo) or remove them"
            )
        return out
    if off.resident_layers and off.hbm_budget_gib is not None:
        out.append(
            "offload.resident_layers and offload.hbm_budget_gib both choose the resident blocks; "
            "set only one"
        )
    allgather_active = (off.use_allgather and par.weight_group is not None
                        if allgather is None else allgather)
    if allgather_active and (off.resident_layers or off.hbm_budget_gib is not None):
        out.append(
            "resident layers are not supported with AllGather sharding (every rank would hold "
            "a full copy of them); set offload.use_allgather=false (--dlo-no-use-allgather) or "
            "drop resident_layers/hbm_budget_gib"
        )
    if allgather_active and off.runtime_cache and off.pin_limit_gib:
        out.append(
            "offload.pin_limit_gib registers runtime-cache mappings, which AllGather mode does "
            "not stream from (it pins its own 1/group shards); set it to 0 or disable AllGather"
        )
    return out


def model_family_problems(family: Any) -> list[str]:
    """The rule for a declared model family: Auto or a family the engine serves.

    Accepts the operator's labels (``QwenImage``) and the CLI's names (``qwen-image``),
    case-insensitively; anything else would start pods whose engine cannot load the model.
    """
    if isinstance(family, str) and (
        family.strip().lower() == AUTO_FAMILY.lower() or family_named(family) is not None
    ):
        return []
    return [f"model.family must be one of {', '.join(MODEL_FAMILIES)}, got {family!r} "
            "(ditserve has no step-wise pipeline for it)"]


# The sequence-parallel implementation (part of a node-cache entry's identity).
SEQUENCE_PARALLEL_IMPL = "ulysses"


def _sizes_dividing(*heads: int) -> str:
    """The SP sizes up to 16 that divide at least one of ``heads``."""
    return ", ".join(str(d) for d in range(1, 17) if any(n % d == 0 for n in heads))


def sequence_parallel_problems(size: int, heads: Mapping[str, int]) -> list[str]:
    """The rule a model's DiTs set for ``sequence_parallel_size``: Ulysses gives every SP rank
    heads / size of each attention's heads, so every DiT's head count must divide by it.

    heads: attention heads per DiT component (``loader.dit_attention_heads``). The engine
    applies it at start, before spawning workers."""
    if size <= 1:
        return []
    return [f"sequence_parallel_size={size} does not divide the {n} attention heads of the "
            f"model's {name}: Ulysses gives every SP rank heads/size of them; use one of "
            f"{_sizes_dividing(n)}" for name, n in heads.items() if n % size]


def family_sequence_parallel_problems(size: int, family: Any) -> list[str]:
    """The same rule judged from a declared family (the operator's ``model.family``) before
    any model is read: a size that divides none of the family's released head counts
    (``Family.attention_heads``) can serve none of its models. A size that divides some of
    them is left to the engine, which reads the model's own count at start."""
    declared = family_named(family) if isinstance(family, str) else None
    if size <= 1 or declared is None or not declared.attention_heads:
        return []
    if any(n % size == 0 for n in declared.attention_heads):
        return []
    counts = ", ".join(str(n) for n in declared.attention_heads)
    return [f"parallelism.sequence={size} divides no attention head count of {declared.label}'s "
            f"released models ({counts}): Ulysses gives every SP rank heads/size heads; use one "
            f"of {_sizes_dividing(*declared.attention_heads)}, or declare model.attentionHeads "
            "(the DiT's num_attention_heads) for a model with another head count"]


def step_cache_problems(cache: StepCacheConfig, *, parallel: ParallelConfig) -> list[str]:
    if cache.policy is None:
        if cache.threshold is not None or cache.every is not None:
            return ["step_cache.threshold and step_cache.every need step_cache.policy "
                    f"(one of {', '.join(STEP_CACHE_POLICIES)})"]
        return []
    if cache.policy not in STEP_CACHE_POLICIES:
        return [f"step_cache.policy must be one of {', '.join(STEP_CACHE_POLICIES)} (or "
                f"unset: off), got {cache.policy!r}"]
    try:
        spec = cache.spec()
        assert spec is not None
        spec.validate()
    except InvalidRequestError as e:
        return [f"step_cache: {e.message}"]
    if parallel.sequence_parallel_size > 1:
        return ["step_cache needs sequence_parallel_size 1: each rank would decide on its own "
                "share of the tokens and the ranks' all-to-alls would no longer match"]
    return []


def validate(config: EngineConfig) -> EngineConfig:
    """Raise ConfigError listing every problem, or return the config unchanged."""
    raise_problems("engine", problems(config))
    return config
