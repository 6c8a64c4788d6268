"""The defaults of a diffusers pipeline's ``__call__``: what a default diffusers call uses.

ditserve's request defaults (``server.model_defaults``, ``ditserve generate``) and each
step-wise pipeline's text length read them here instead of keeping copies, so a request that
leaves guidance, CFG or text length out runs what the same default diffusers call runs.
Imports diffusers on first use only.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any


@functools.cache
def call_defaults(pipeline_class: str) -> Mapping[str, Any]:
    """The defaults of a diffusers pipeline's ``__call__`` by argument name (``guidance_scale``,
    ``true_cfg_scale``, ``max_sequence_length``, ``num_inference_steps``, ...): what a default
    diffusers call uses, so ditserve's defaults are the pipeline's own, not copies of them."""
    import inspect

    import diffusers

    signature = inspect.signature(getattr(diffusers, pipeline_class).__call__)
    return MappingProxyType({name: parameter.default
                             for name, parameter in signature.parameters.items()
                             if parameter.default is not inspect.Parameter.empty})
