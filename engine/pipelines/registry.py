"""The torch side of the family registry: a loaded model's StepPipeline.

Each family's record (``engine.families``) names its StepPipeline lazily
(``Family.step_pipeline``); this module imports it on first use and builds it. A test keeps
both in step (every family's pipeline declares that family).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ditserve.engine.errors import ModelLoadError
from ditserve.engine.families import FAMILIES, resolve

if TYPE_CHECKING:
    from ditserve.engine.pipelines.base import StepPipeline
    from ditserve.engine.weights.loader import LoadedComponents

# family name -> "module:class" of its StepPipeline
PIPELINES: dict[str, str] = {f.name: f.step_pipeline for f in FAMILIES}


def pipeline_class(family_name: str) -> Any:
    """The StepPipeline class of a family (imports its module)."""
    target = PIPELINES.get(family_name)
    if target is None:
        raise ModelLoadError(
            f"no step-wise pipeline for the {family_name!r} family; registered: "
            f"{', '.join(PIPELINES)}")
    return resolve(target)


def build_pipeline(
    components: LoadedComponents, *, device: torch.device, move_transformer: bool = True
) -> StepPipeline:
    """The StepPipeline for a loaded model; ``move_transformer`` False leaves the DiT(s) on
    the CPU (the offload backend places them). Text encoders stay where the loader put
    them: the whole pipeline's plan places them (engine.placement.whole_pipeline)."""
    cls = pipeline_class(components.family.name)
    pipeline: StepPipeline = cls(components, device=device, move_transformer=move_transformer)
    return pipeline
