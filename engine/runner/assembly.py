"""From loaded weights to a pipeline ready to step: the order the wrappers go on in.

Each wrapper sits around what the next one sees, so the order is the contract: the step-wise
pipeline is built; sequence parallelism shards it (before offload and compilation, which wrap
the blocks its hooks sit around); LoRA adapters open (a fused adapter changes the weights
before quantization and offload read them); FP8 replaces the DiT's linears (before offload
plans their tensors); offload takes the host-weight plan and streams the blocks; adapter
hooks go on the final linears; compilation wraps the blocks last. Called by ``ModelRunner``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ditserve.engine.config import EngineConfig
from ditserve.engine.errors import ConfigError
from ditserve.engine.pipelines import StepPipeline, build_pipeline
from ditserve.engine.runner.budget_plan import GIB, BudgetInputs, BudgetPlan, plan_budget
from ditserve.engine.weights.load import LoadedWeights

if TYPE_CHECKING:
    from ditserve.engine.offload import OffloadHandle

log = logging.getLogger(__name__)


@dataclass
class Assembled:
    """The pipeline, its adapter bank and its offload handle (None: resident)."""

    pipeline: StepPipeline
    adapters: Any
    offload: OffloadHandle | None
    inputs: BudgetInputs | None = None  # the memory planner's inputs (None: not plannable)
    budget: BudgetPlan | None = None  # the plan --dlo-hbm-budget-gib chose


def assemble(loaded: LoadedWeights, config: EngineConfig, *, device: torch.device,
             sequence: Any = None, weight_group: Any = None) -> Assembled:
    """Wrap the loaded components in the module docstring's order. ``sequence``: this
    process's SP group (None: no SP); ``weight_group``: the group DLO shards weights over."""
    offload = config.offload.enabled
    pipeline = build_pipeline(loaded.components, device=device, move_transformer=not offload)
    if sequence is not None:
        from ditserve.engine.parallel import shard_pipeline

        shard_pipeline(pipeline, sequence)
    from ditserve.engine.adapters import bank

    adapters = bank.open_bank(pipeline, loaded.components, config.adapters, device=device)
    if config.quantization is not None:
        from ditserve.engine.weights.quantize import quantize_dit

        quantize_dit(pipeline.transformer, config.quantization, device=device)
    inputs = _planner_inputs(pipeline, config)
    budget = _budget_plan(inputs, config, device)
    handle = None
    if offload:
        from ditserve.engine.offload import enable_offload

        kwargs: dict[str, Any] = {}
        if weight_group is not None and config.offload.use_allgather:
            kwargs["group"] = weight_group  # 1/group shards, rebuilt by all_gather
        offload_config = config.offload
        if budget is not None:
            # The whole-pipeline plan already paid for activations, encoders and the VAE:
            # the offload spends only the DiT's share on resident blocks.
            offload_config = replace(offload_config, hbm_budget_gib=budget.dit_budget / GIB)
            kwargs["activation_reserve_bytes"] = 0
        handle = enable_offload(pipeline.transformer, offload_config, device=device,
                                host_plan=loaded.host_plan, block_lists=pipeline.block_lists,
                                host_modules=getattr(pipeline, "host_modules", ()), **kwargs)
    bank.preload(adapters, config.adapters)
    if config.compile is not None:
        from ditserve.engine.runner.compiled_blocks import compile_repeated_blocks

        compile_repeated_blocks(pipeline.transformer, config.compile)
    return Assembled(pipeline, adapters, handle, inputs, budget)


def _planner_inputs(pipeline: Any, config: EngineConfig) -> BudgetInputs | None:
    """The memory planner's inputs; without a budget they only inform the printed plan, so
    a model they cannot be read from still serves (None)."""
    from ditserve.engine.runner.memory_estimates import budget_inputs

    try:
        return budget_inputs(pipeline, config)
    except Exception as e:
        if config.offload.hbm_budget_gib is not None:
            raise ConfigError(f"--dlo-hbm-budget-gib: cannot plan this pipeline's memory: "
                              f"{type(e).__name__}: {e}") from e
        log.warning("no memory estimates for the plan: %s: %s", type(e).__name__, e)
        return None


def _budget_plan(inputs: BudgetInputs | None, config: EngineConfig,
                 device: torch.device) -> BudgetPlan | None:
    """The plan of ``--dlo-hbm-budget-gib`` (a number or ``auto``); None without one.
    Raises ``BudgetError`` (a ConfigError) when even the smallest placement does not fit."""
    wanted = config.offload.hbm_budget_gib
    if wanted is None or inputs is None:
        return None
    from ditserve.engine.runner.memory_estimates import auto_budget

    auto = wanted == "auto"
    budget = auto_budget(device) if auto else int(float(wanted) * GIB)
    return plan_budget(inputs, budget, auto=auto)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    return device


def weights_replaced(config: EngineConfig) -> str | None:
    """Why the DiT's linear weights change after loading (then they load privately)."""
    if config.quantization:
        return f"--quantization {config.quantization} replaces the linears' weights"
    return "--lora-fuse changes the linears' weights" if config.adapters.fuse else None
