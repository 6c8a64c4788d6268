"""From loaded weights to a pipeline ready to step: the order the wrappers go on in.

Each wrapper sits around what the next one sees, so the order is the contract: the step-wise
pipeline is built; sequence parallelism shards it (before offload and compilation, which wrap
the blocks its hooks sit around); LoRA adapters open (a fused adapter changes the weights
before quantization and offload read them); FP8 replaces the DiT's linears (before offload
plans their tensors); offload takes the host-weight plan and streams the blocks; adapter
hooks go on the final linears; compilation wraps the blocks last. Called by ``ModelRunner``,
with the sub-configs each step uses and the offload as the composition root resolved it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ditserve.engine.config import (
    DType,
    OffloadConfig,
    PipelineConfig,
    ResolvedOffload,
    SchedulerConfig,
)
from ditserve.engine.config.adapters import AdapterConfig
from ditserve.engine.config.types import CompileBackend
from ditserve.engine.errors import ConfigError
from ditserve.engine.pipelines import StepPipeline, build_pipeline
from ditserve.engine.pipelines.capabilities import host_modules_of
from ditserve.engine.placement.budget_plan import (
    GIB,
    BudgetError,
    BudgetInputs,
    BudgetPlan,
    FittedSettings,
    plan_budget,
)
from ditserve.engine.runner.start_phases import StartTimeline, timed
from ditserve.engine.weights.load import LoadedWeights, load_weights
from ditserve.engine.weights.loader import import_pipeline_class, model_family

if TYPE_CHECKING:
    from ditserve.engine.offload import OffloadHandle
    from ditserve.engine.offload.host.weight_plan import HostWeightPlan

log = logging.getLogger(__name__)


@dataclass
class Assembled:
    """The pipeline, its adapter bank and its offload handle (None: resident)."""

    pipeline: StepPipeline
    adapters: Any
    offload: OffloadHandle | None
    inputs: BudgetInputs | None = None  # the memory planner's inputs (None: not plannable)
    budget: BudgetPlan | None = None  # the plan --dlo-hbm-budget-gib chose
    pipeline_class: str = ""  # the diffusers pipeline class the model directory names


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """What the memory plan reads and may lower (``fit_settings``): the scheduling and the
    pipeline's parts around the DiT, with the offload they are planned under."""

    scheduler: SchedulerConfig
    pipeline: PipelineConfig
    offload: ResolvedOffload


def load_and_assemble(model_dir: str | Path, *, dtype: DType, checkpoint: str | None,
                      sp_size: int, quantization: str | None, adapters: AdapterConfig,
                      compile: CompileBackend | None, settings: PlanSettings,
                      device: torch.device, sequence: Any = None, weight_group: Any = None,
                      timeline: StartTimeline | None = None) -> Assembled:
    """``read_weights`` then ``assemble``: the model of ``model_dir`` ready to step on
    ``device``. The host-weight plan is closed if assembling fails, and checked to have been
    taken exactly once when it succeeds."""
    offload = settings.offload
    loaded = read_weights(
        model_dir, dtype=dtype, offload=offload, sp_size=sp_size, checkpoint=checkpoint,
        keep_private=weights_replaced(quantization=quantization, fuse=adapters.fuse),
        device=device, timeline=timeline,
        sharded=weight_group is not None and offload.allgather)
    host_plan = loaded.host_plan
    try:
        built = assemble(loaded, settings, adapters=adapters, quantization=quantization,
                         compile=compile, device=device, sequence=sequence,
                         weight_group=weight_group, timeline=timeline)
    except BaseException:
        if host_plan is not None:
            host_plan.close()
        raise
    if host_plan is not None:
        # Exactly once: a plan that replaced the ordinary load must have been taken.
        host_plan.require_consumed()
    return replace(built, pipeline_class=loaded.components.pipeline_class)


def read_weights(model_dir: str | Path, *, dtype: DType, offload: ResolvedOffload,
                 sp_size: int, checkpoint: str | None, keep_private: str | None,
                 device: torch.device, sharded: bool,
                 timeline: StartTimeline | None = None) -> LoadedWeights:
    """The model's classes imported (start phase ``imports``), then its weights in host
    memory (``read``), while the CUDA context is made (``cuda_init``, on its own thread:
    ``context_meanwhile``): the first CUDA call makes it wherever it falls, so make it here,
    beside the imports and the reading that need no device, and time them apart from it.
    ``sharded``: DLO shards over a weight group; ``keep_private``: why the DiT's weights
    change after loading (``weights_replaced``)."""
    with context_meanwhile(device, timeline):
        with timed(timeline, "imports"):
            import_pipeline_class(model_family(model_dir))  # at once if already imported
        with timed(timeline, "read"):
            return load_weights(
                model_dir, dtype=dtype, offload=offload.options, sp_size=sp_size,
                streams_from_mapping=(device.type == "cuda" and not sharded
                                      and offload.options.compress == "none"),
                keep_private=keep_private, sharded=sharded, checkpoint=checkpoint,
            )


def first_allocation(device: torch.device) -> None:
    """What makes a device's CUDA context: its first allocation."""
    torch.empty(0, device=device)


@contextlib.contextmanager
def context_meanwhile(device: torch.device, timeline: StartTimeline | None = None, *,
                      make_context: Callable[[torch.device], Any] = first_allocation,
                      ) -> Iterator[None]:
    """Make ``device``'s CUDA context on a thread while the body runs; ready on exit.

    Reading the weights (headers, building modules on the checkpoints' mappings, tokenizers)
    needs no device, and creating the context (driver, context, caching allocator) runs in
    CUDA with the GIL released by torch's factory call, so the two overlap instead of adding
    up. The context's failure is raised on exit, after the body's own (which wins); nothing
    happens for another device."""
    if device.type != "cuda":
        yield
        return
    failure: list[BaseException] = []

    def make() -> None:
        try:
            with timed(timeline, "cuda_init"):
                make_context(device)
        except BaseException as e:  # raised on the caller's thread below
            failure.append(e)

    thread = threading.Thread(target=make, name="cuda-context", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()
    if failure:
        raise failure[0]


def assemble(loaded: LoadedWeights, settings: PlanSettings, *, adapters: AdapterConfig,
             quantization: str | None, compile: CompileBackend | None, device: torch.device,
             sequence: Any = None, weight_group: Any = None,
             timeline: StartTimeline | None = None) -> Assembled:
    """Wrap the loaded components in the module docstring's order. ``sequence``: this
    process's SP group (None: no SP); ``weight_group``: the group DLO shards weights over;
    ``timeline``: where the start phases ``place`` and ``pin_register`` are recorded."""
    offload = settings.offload
    with timed(timeline, "place"):
        pipeline = build_pipeline(loaded.components, device=device,
                                  move_transformer=not offload.enabled)
    if sequence is not None:
        from ditserve.engine.parallel import shard_pipeline

        shard_pipeline(pipeline, sequence)
    from ditserve.engine.adapters import bank

    adapter_bank = bank.open_bank(pipeline, loaded.components, adapters, device=device)
    if quantization is not None:
        from ditserve.engine.weights.quantize import quantize_dit

        quantize_dit(pipeline.transformer, quantization, device=device)
    inputs = _planner_inputs(pipeline, settings)
    budget = _budget_plan(inputs, settings, device, pipeline)
    handle = None
    if offload.enabled:
        from ditserve.engine.offload import enable_offload

        kwargs: dict[str, Any] = {}
        if weight_group is not None and offload.allgather:
            kwargs["group"] = weight_group  # 1/group shards, rebuilt by all_gather
        offload_config = offload.dit_options()
        if budget is not None:
            # The whole-pipeline plan already paid for activations, encoders and the VAE:
            # the offload spends only the DiT's share on resident blocks.
            offload_config = offload.dit_options(budget_gib=budget.dit_budget / GIB)
            kwargs["activation_reserve_bytes"] = 0
        offload_config = with_auto_pin_limit(offload_config, loaded.host_plan)
        with timed(timeline, "pin_register"):
            handle = enable_offload(pipeline.transformer, offload_config, device=device,
                                    host_plan=loaded.host_plan,
                                    block_lists=pipeline.block_lists,
                                    host_modules=host_modules_of(pipeline), **kwargs)
    bank.preload(adapter_bank, adapters)
    if compile is not None:
        from ditserve.engine.runner.compiled_blocks import compile_repeated_blocks

        compile_repeated_blocks(pipeline.transformer, compile)
    return Assembled(pipeline, adapter_bank, handle, inputs, budget)


def with_auto_pin_limit(options: OffloadConfig, host_plan: HostWeightPlan | None
                        ) -> OffloadConfig:
    """``options`` with the registration budget the loader chose for its mapping (a
    checkpoint on tmpfs: ``weights.host_fit``) when ``--dlo-pin-limit-gib`` set none."""
    auto = host_plan.auto_pin_limit_bytes if host_plan is not None else 0
    if not auto or options.pin_limit_gib > 0:
        return options
    return replace(options, pin_limit_gib=auto / GIB)


def _budget_inputs(pipeline: Any, settings: PlanSettings) -> BudgetInputs:
    from ditserve.engine.placement.memory_estimates import budget_inputs

    return budget_inputs(pipeline, scheduler=settings.scheduler,
                         pipeline_config=settings.pipeline, offload=settings.offload)


def _planner_inputs(pipeline: Any, settings: PlanSettings) -> BudgetInputs | None:
    """The memory planner's inputs; without a budget they only inform the printed plan, so
    a model they cannot be read from still serves (None)."""
    try:
        return _budget_inputs(pipeline, settings)
    except Exception as e:
        if settings.offload.budget_gib is not None:
            raise ConfigError(f"--dlo-hbm-budget-gib: cannot plan this pipeline's memory: "
                              f"{type(e).__name__}: {e}") from e
        log.warning("no memory estimates for the plan: %s: %s", type(e).__name__, e)
        return None


def _budget_plan(inputs: BudgetInputs | None, settings: PlanSettings,
                 device: torch.device, pipeline: Any) -> BudgetPlan | None:
    """The plan of ``--dlo-hbm-budget-gib`` (a number or ``auto``); None without one.
    Raises ``BudgetError`` (a ConfigError) when even the smallest placement does not fit,
    after lowering the prompt cache's bound and the requests per step (``fit_settings``)."""
    wanted = settings.offload.budget_gib
    if wanted is None or inputs is None:
        return None
    from ditserve.engine.placement.memory_estimates import auto_budget

    auto = wanted == "auto"
    budget = auto_budget(device) if auto else int(float(wanted) * GIB)
    try:
        return plan_budget(inputs, budget, auto=auto)
    except BudgetError as refused:
        fitted = fit_settings(pipeline, settings, budget, auto=auto)
        if fitted is None:
            raise BudgetError(f"{refused} (one request per step with a "
                              f"{SMALL_PROMPT_CACHE_GIB:g} GiB prompt cache does not fit "
                              "either)", refused.minimum_bytes) from None
        for change in fitted.settings.changes if fitted.settings else ():
            log.warning("--dlo-hbm-budget-gib %s: lowered %s so the budget holds (set it "
                        "yourself to choose another trade)", wanted, change)
        return fitted


# The prompt cache's bound the planner may lower to (a few hundred Flux prompts' embeddings).
SMALL_PROMPT_CACHE_GIB = 0.25


def fit_settings(pipeline: Any, settings: PlanSettings, budget: int, *,
                 auto: bool) -> BudgetPlan | None:
    """A plan under ``budget`` with the prompt cache's bound, then the requests per step
    (and with them the step's work budget and the prompts of one encoder pass) lowered as
    little as it takes; None when even one request per step with a small cache does not
    fit. The scheduler and the prompt cache then run with those settings."""
    sched, pipe = settings.scheduler, settings.pipeline
    cache_gib = min(pipe.prompt_cache_gib, SMALL_PROMPT_CACHE_GIB)
    seqs = sched.max_num_seqs
    while seqs >= 1:
        tokens = (None if sched.max_batch_tokens is None
                  else max(1, sched.max_batch_tokens * seqs // sched.max_num_seqs))
        candidate = replace(settings, scheduler=replace(sched, max_num_seqs=seqs,
                                                        max_batch_tokens=tokens),
                            pipeline=replace(pipe, prompt_cache_gib=cache_gib))
        try:
            plan = plan_budget(_budget_inputs(pipeline, candidate), budget, auto=auto)
        except BudgetError:
            seqs = seqs // 2 if seqs > 1 else 0
            continue
        changes = []
        if cache_gib != pipe.prompt_cache_gib:
            changes.append(f"--prompt-cache-gib {pipe.prompt_cache_gib:g} -> {cache_gib:g}")
        if seqs != sched.max_num_seqs:
            changes.append(f"--max-num-seqs {sched.max_num_seqs} -> {seqs}"
                           + (f" (--max-batch-tokens {sched.max_batch_tokens} -> {tokens})"
                              if tokens is not None else " (and the step's work budget, "
                              "max_num_seqs requests of the family's usual size, with it)"))
        return replace(plan, settings=FittedSettings(
            max_num_seqs=seqs, max_batch_tokens=tokens, prompt_cache_gib=cache_gib,
            changes=tuple(changes)))
    return None


def with_fitted_settings(settings: PlanSettings, plan: BudgetPlan | None) -> PlanSettings:
    """``settings`` with the scheduling and prompt cache the budget's plan lowered
    (unchanged without any)."""
    fitted: FittedSettings | None = plan.settings if plan is not None else None
    if fitted is None:
        return settings
    return replace(settings,
                   scheduler=replace(settings.scheduler, max_num_seqs=fitted.max_num_seqs,
                                     max_batch_tokens=fitted.max_batch_tokens),
                   pipeline=replace(settings.pipeline, prompt_cache_gib=fitted.prompt_cache_gib))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    return device


def weights_replaced(*, quantization: str | None, fuse: bool) -> str | None:
    """Why the DiT's linear weights change after loading (then they load privately)."""
    if quantization:
        return f"--quantization {quantization} replaces the linears' weights"
    return "--lora-fuse changes the linears' weights" if fuse else None
