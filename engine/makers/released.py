"""The parts around a DiT at their released shapes, with random weights.

``build_released(table, ...)`` makes every component of a family's ``released_components``
table (``engine.families``; e.g. Flux: CLIP-L's text tower, T5-XXL's encoder, Flux's VAE)
through its own library class, so the written ``config.json`` is the released one's and a
load builds exactly the released module. Each is allocated and randomly initialized in the
target dtype on the target device (``allocating``): on a GPU a 5B-parameter encoder takes
seconds and never touches host memory; on the meta device it costs nothing (what the tests
use to check a full-size build's shapes and bytes). Nothing is downloaded.

Called by the family builder modules (``engine.families.flux.builders`` and the others) when
``init-random`` builds ``--components all``; ``make_dit`` (``engine.makers.builders``) shares
``allocating``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from ditserve.engine.families.base import ComponentShape


@contextmanager
def allocating(dtype: Any, device: Any) -> Iterator[None]:
    """Modules built in the body allocate (and initialize) their tensors in ``dtype`` on
    ``device``: a full-size model never needs a float32 copy, nor a host copy on a GPU."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def merged(config: Mapping[str, Any], extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """``config`` with ``extra``'s values over it, nested mappings merged key by key."""
    out = dict(config)
    for key, value in (extra or {}).items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def make_component(shape: ComponentShape, *, dtype: Any, device: Any,
                   extra: Mapping[str, Any] | None = None) -> Any:
    """One component of ``shape`` (its config plus ``extra``), random, eval, no grad."""
    library = importlib.import_module(shape.library)
    model_cls = getattr(library, shape.model_class)
    config = merged(shape.config, extra)
    with allocating(dtype, device):
        if shape.config_class is None:
            model = model_cls(**config)
        else:
            model = model_cls(getattr(library, shape.config_class)(**config))
    return model.eval().requires_grad_(False)


def build_released(table: Mapping[str, ComponentShape], *, dtype: Any, device: Any, seed: int,
                   ids: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Every component of ``table``, by name. ``ids``: per component, the config values the
    builders' in-code tokenizers decide (special-token ids), merged over the table's."""
    import torch

    from ditserve.engine.makers.writing import finished

    modules = {}
    for index, (name, shape) in enumerate(table.items()):
        # One seed per component: its weights do not depend on what was built before it.
        torch.manual_seed(seed + 1000 * (index + 1))
        # Written and emptied at once when init-random writes (engine.makers.writing).
        modules[name] = finished(name, make_component(shape, dtype=dtype, device=device,
                                                      extra=(ids or {}).get(name)))
    return modules
