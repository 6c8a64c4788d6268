"""Placement: where the pipeline around the DiT lives and when it moves.

The runner executes steps (``engine.runner``); this package decides and carries out the
placement of everything else under one HBM budget: the whole pipeline's plan
(``whole_pipeline``, ``budget_plan``, ``memory_estimates``, ``component_placement``), text
encoders streamed layer by layer or parked (``encoder_streaming``), the prompt cache and
batched prompt encoding (``prompt_cache``, ``batched_encode``) and decode batches
(``decode_batches``).
"""
