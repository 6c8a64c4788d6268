"""From loaded weights to a pipeline ready to step: the order the wrappers go on in.

Each wrapper sits around what the next one sees, so the order is the contract: the step-wise
pipeline is built; sequence parallelism shards it (before offload and compilation, which wrap
the blocks its hooks sit around); LoRA adapters open (a fused adapter changes the weights
before quantization and offload read them); FP8 replaces the DiT's linears (before offload
plans their tensors); offload takes the host-weight plan and streams the blocks; adapter
hooks go on the final linears; compilation wraps the blocks last. Called by ``ModelRunner``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ditserve.engine.config import EngineConfig
from ditserve.engine.pipelines import StepPipeline, build_pipeline
from ditserve.engine.weights.load import LoadedWeights


@dataclass
class Assembled:
    """The pipeline, its adapter bank and its offload handle (None: resident)."""

    pipeline: StepPipeline
    adapters: Any
    offload: Any


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
    handle = None
    if offload:
        from ditserve.engine.offload import enable_offload

        kwargs: dict[str, Any] = {}
        if weight_group is not None and config.offload.use_allgather:
            kwargs["group"] = weight_group  # 1/group shards, rebuilt by all_gather
        handle = enable_offload(pipeline.transformer, config.offload, device=device,
                                host_plan=loaded.host_plan, block_lists=pipeline.block_lists,
                                **kwargs)
    bank.preload(adapters, config.adapters)
    if config.compile is not None:
        from ditserve.engine.runner.compiled_blocks import compile_repeated_blocks

        compile_repeated_blocks(pipeline.transformer, config.compile)
    return Assembled(pipeline, adapters, handle)
