"""Step-wise pipelines: diffusers components driven one denoise step at a time.

``StepPipeline`` is the contract the model runner calls; ``build_pipeline`` picks the
implementation for a loaded model directory.
"""

from ditserve.engine.pipelines.base import StepPipeline, build_pipeline

__all__ = ["StepPipeline", "build_pipeline"]
