"""The torch-side family registry: which StepPipeline implements each family.

Keyed by the family names of the pure table (``engine.families``); a test keeps both in
step (every registered family has a pipeline declaring that family, and nothing else is
registered). Pipeline modules are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch

from ditserve.engine.errors import ModelLoadError

if TYPE_CHECKING:
    from ditserve.engine.pipelines.base import StepPipeline
    from ditserve.engine.weights.loader import LoadedComponents

# family name -> "module:class" of its StepPipeline
PIPELINES: dict[str, str] = {
    "flux": "ditserve.engine.pipelines.flux:FluxStepPipeline",
    "qwen-image": "ditserve.engine.pipelines.qwen_image:QwenImageStepPipeline",
    "wan": "ditserve.engine.pipelines.wan:WanStepPipeline",
    "flux-kontext": "ditserve.engine.pipelines.flux_kontext:FluxKontextStepPipeline",
    "wan-i2v": "ditserve.engine.pipelines.wan_i2v:WanI2VStepPipeline",
}


def pipeline_class(family_name: str) -> Any:
    """The StepPipeline class of a family (imports its module)."""
    target = PIPELINES.get(family_name)
    if target is None:
        raise ModelLoadError(
            f"no step-wise pipeline for the {family_name!r} family; registered: "
            f"{', '.join(PIPELINES)}")
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def build_pipeline(
    components: LoadedComponents, *, device: torch.device, move_transformer: bool = True
) -> StepPipeline:
    """The StepPipeline for a loaded model; ``move_transformer`` False leaves the DiT(s) on
    the CPU (the offload backend places them)."""
    cls = pipeline_class(components.family.name)
    pipeline: StepPipeline = cls(components, device=device, move_transformer=move_transformer)
    return pipeline
