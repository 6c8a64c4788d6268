"""Engine configuration rules: which option values and combinations are rejected, and why.

The one set of rules the engine CLI, the HTTP server (``--config`` YAML) and the Kubernetes
operator all apply (``validate``, and the family / sequence-parallel / format rules the operator
calls on a spec before any model is read), so a spec is judged the same way everywhere. Each
rule returns messages that say how to fix the config. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.config.adapters import adapter_problems
from ditserve.engine.config.dequant_rules import dequant_problems
from ditserve.engine.config.judged import judged, remember_judged
from ditserve.engine.config.step_cache import POLICIES as STEP_CACHE_POLICIES
from ditserve.engine.config.types import (
    CHECKPOINT_MMAP_MODES,
    COMPILE_BACKENDS,
    COMPRESS_MODES,
    DLO_COMPONENTS,
    DTYPES,
    GATHER_ENGINES,
    HBM_BUDGET_AUTO,
    MODEL_FAMILIES,
    PACKED_STRIPES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    VAE_TILING_MODES,
    EngineConfig,
    OffloadConfig,
    ParallelConfig,
    StepCacheConfig,
    raise_problems,
    use_judge,
)
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.families import AUTO_FAMILY, family_named


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
    if sch.max_request_tokens is not None:
        int_at_least(out, "scheduler.max_request_tokens", sch.max_request_tokens, 1)
    int_at_least(out, "scheduler.max_bypass", sch.max_bypass, 0)
    if sch.max_queue is not None:
        int_at_least(out, "scheduler.max_queue", sch.max_queue, 0)
    if sch.scheduling_policy not in SCHEDULING_POLICIES:
        out.append(f"scheduler.scheduling_policy must be one of "
                   f"{', '.join(SCHEDULING_POLICIES)}, got {sch.scheduling_policy!r}")
    number_at_least(out, "scheduler.aging_s", sch.aging_s, 0.001)
    int_at_least(out, "scheduler.max_preemptions", sch.max_preemptions, 0)
    if sch.urgent_companions is not None:
        int_at_least(out, "scheduler.urgent_companions", sch.urgent_companions, 0)
    if not (isinstance(sch.plan_at, (int, float)) and 0 <= sch.plan_at < 1):
        out.append(f"scheduler.plan_at must be a number >= 0 and < 1, got {sch.plan_at!r}")

    pipe = config.pipeline
    int_at_least(out, "pipeline.prompt_cache_size", pipe.prompt_cache_size, 0)
    number_at_least(out, "pipeline.prompt_cache_gib", pipe.prompt_cache_gib, 0)
    if pipe.vae_tiling not in VAE_TILING_MODES:
        out.append(f"pipeline.vae_tiling must be one of {', '.join(VAE_TILING_MODES)}, "
                   f"got {pipe.vae_tiling!r}")

    out.extend(checkpoint_problems(config))
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


def checkpoint_problems(config: EngineConfig) -> list[str]:
    """The rules for serving a DiT checkpoint file (``checkpoint``): it needs a base model
    directory and keeps its own stored form (under offload the runtime cache holds it in
    that form: ``weights.checkpoint_cache``)."""
    if config.checkpoint is None:
        return []
    out = []
    if config.model is None:
        out.append("a checkpoint file needs a base model: pass --base-model DIR (a diffusers "
                   "directory of the same family) for its config and other components")
    if config.quantization is not None:
        out.append("a checkpoint file's DiT keeps the form it is stored in (GGUF, FP8 or "
                   "--dtype); drop --quantization, or convert the file "
                   "(ditserve model convert --to fp8)")
    if config.adapters.fuse:
        out.append("--lora-fuse merges an adapter into dense weights, which a checkpoint file's "
                   "GGUF or FP8 layers are not; serve adapters unfused (drop --lora-fuse)")
    return out


def format_problems(
    off: OffloadConfig, *, quantization: str | None = None, dtype: str | None = None,
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
    out.extend(dequant_problems(off, quantization=quantization, group_size=group_size))
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
    if off.hbm_budget_gib is not None and off.hbm_budget_gib != HBM_BUDGET_AUTO:
        number_at_least(out, "offload.hbm_budget_gib", off.hbm_budget_gib, 0)
        if out and out[-1].startswith("offload.hbm_budget_gib"):
            out[-1] += f" or {HBM_BUDGET_AUTO!r} (the device's free HBM)"
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
                ("use_allgather", not off.use_allgather),
                ("gather", off.gather != "nccl"),
                ("checkpoint_mmap", off.checkpoint_mmap != "auto"),
                ("components", off.components != "all"),
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
    """Raise ConfigError listing every problem, or return the config unchanged. The rules run
    once per config object: a config judged before is returned as it is."""
    if judged(config):
        return config
    raise_problems("engine", problems(config))
    remember_judged(config)
    return config


use_judge(validate)
