"""Weights: everything that turns a model directory into tensors in host memory.

``loader`` reads ``model_index.json`` and builds each component through its family's diffusers
classes; ``backing_choice`` decides where a DiT's host bytes live (private memory, the
checkpoint's own safetensors mapped read-only by ``checkpoint_mmap``, or a node cache entry
joined by ``runtime_cache``); ``dit_backing`` does that for every DiT of a model (Wan 2.2's two
experts) and combines their plans; ``quantize`` turns the DiT's linear layers into FP8.

What this package hands the offload layer is a ``HostWeightPlan`` (``offload.host.weight_plan``)
and nothing else: offload never imports weights or the node cache (an import-linter contract).
Called by the model runner, ``cachectl build`` (the loader, lazily) and benchmarks.
"""
