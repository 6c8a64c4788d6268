"""Step-wise pipelines: diffusers components driven one denoise step at a time.

``StepPipeline`` is the contract the model runner calls; ``build_pipeline`` picks the
family's implementation (``registry``) for a loaded model directory: Flux (``flux``),
Qwen-Image (``qwen_image``), Wan 2.1 / 2.2 (``wan``, with ``experts`` for Wan 2.2).
"""

from ditserve.engine.pipelines.base import StepPipeline
from ditserve.engine.pipelines.registry import build_pipeline

__all__ = ["StepPipeline", "build_pipeline"]
