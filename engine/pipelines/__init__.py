"""Step-wise pipelines: diffusers components driven one denoise step at a time.

``StepPipeline`` is the contract the model runner calls; ``build_pipeline`` picks the
family's implementation (``registry``) for a loaded model directory. The implementations live
in each family's folder (``engine/families/<family>/pipeline.py``); this package holds what
they share: uploads and seeded noise (``common``), image conditioning (``conditioning``),
experts switched per step (``experts``), host-side token tables (``host_embedding``) and the
budgeted VAE decode (``vae_decode``).
"""

from ditserve.engine.pipelines.base import StepPipeline
from ditserve.engine.pipelines.registry import build_pipeline

__all__ = ["StepPipeline", "build_pipeline"]
