"""Random-weight pipelines at chosen sizes, for benchmarks (`ditserve model init-random`).

Every variant of ``engine.families.MODEL_VARIANTS``, built by its family's builder module
(``engine.makers.builders``): the DiT has the family's shapes at the size asked for, and
``components`` chooses what surrounds it:

- ``all`` (the default at ``--size full``): every text encoder, image encoder and VAE at its
  released shape - for Flux, ``init_random(dir, family="flux", size="full")`` writes
  FLUX.1-dev's architecture whole: the DiT (19 double + 38 single blocks, 3072 wide, ~11.9B
  parameters), CLIP-L's text tower, T5-XXL's encoder (~4.8B parameters) and Flux's VAE, ~34 GB
  in bfloat16; Qwen-Image adds Qwen2.5-VL-7B (16.6 GB), Wan UMT5-XXL (11.4 GB);
- ``dit`` (the default at the other sizes): deliberately tiny text encoders (their output
  widths match what the DiT expects) and a tiny VAE with the family's latent layout, so the
  DiT - the part DLO streams and batching amortizes - is the only large part.

Sizes: ``full`` (the released DiT), ``small`` (the same widths with two or a few blocks and 4
heads: for CPU checks) and ``tiny`` (a few MB; tiny parts only).

Every module is allocated and initialized once, in the target dtype, on ``device``, and the
pipeline is written a component at a time (``engine.makers.writing``): each DiT and
released-shape encoder or VAE is saved as soon as it is built and freed before the next is
built, so the peak memory is about the largest component, not the pipeline's sum (FLUX.2
[dev]: its 60 GiB DiT, not that plus its 45 GiB Mistral encoder). On a GPU a full pipeline
builds in seconds and is written from there a tensor at a time, so the host holds about one
shard (5 GB) at a time; on a CPU it needs the largest component's size in free RAM and
minutes of random initialization. Writing the directory needs the pipeline's size in disk.
The files are those a whole build would write, byte for byte. Weights are never downloaded.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ditserve.engine.errors import ConfigError
from ditserve.engine.families import MODEL_VARIANTS
from ditserve.engine.families.base import ComponentShape
from ditserve.engine.makers.tiny_model import refuse_foreign_directory

log = logging.getLogger(__name__)

FAMILIES = tuple(MODEL_VARIANTS)
SIZES = ("tiny", "small", "full")
COMPONENTS = ("all", "dit")
_COMPLETE_MARKER = ".ditserve-random-complete"
_STARTED_MARKER = ".ditserve-random-started"  # removed once the complete marker is written


def _resolve_device(name: str) -> Any:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def init_random(
    path: str | os.PathLike[str],
    *,
    family: str = "flux",
    size: str = "full",
    dtype: str = "bfloat16",
    device: str = "auto",
    seed: int = 0,
    components: str | None = None,
) -> Path:
    """Write the pipeline directory (see module docstring); idempotent once complete.
    components: "all" or "dit"; None: "all" at ``size="full"``, else "dit"."""
    chosen = default_components(size) if components is None else components
    if family not in FAMILIES:
        raise ConfigError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if size not in SIZES:
        raise ConfigError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    if chosen not in COMPONENTS:
        raise ConfigError(f"components must be one of {', '.join(COMPONENTS)}, "
                          f"got {chosen!r}")
    target = Path(path)
    marker = target / _COMPLETE_MARKER
    wanted = {"family": family, "size": size, "components": chosen, "dtype": dtype,
              "seed": seed, "random_weights": True}
    if marker.exists():
        found = json.loads(marker.read_text())
        found.setdefault("components", "dit")  # written before there was a choice
        found.pop("transformer_parameters", None)
        found.pop("parameters", None)
        if found != wanted:
            raise ConfigError(f"{str(target)!r} already holds a different random model "
                              f"({found}); choose another directory")
        return target
    _claim(target, wanted)
    started = time.perf_counter()
    params = write_pipeline(target, family, size, dtype=dtype, device=_resolve_device(device),
                            seed=seed, components=chosen)
    dit_params = sum(n for name, n in params.items() if name.startswith("transformer"))
    marker.write_text(json.dumps({**wanted, "transformer_parameters": dit_params,
                                  "parameters": params}))
    (target / _STARTED_MARKER).unlink()
    log.info("wrote a random %s-size %s pipeline (%s) to %s: %s in %.1fs", size, family,
             "every component at released shape" if chosen == "all" else "tiny encoders",
             target, ", ".join(f"{name} {n / 1e9:.2f}B" for name, n in params.items()),
             time.perf_counter() - started)
    return target


def _claim(target: Path, wanted: dict[str, Any]) -> None:
    """Mark ``target`` as being written with ``wanted`` before the first byte, so that a run
    interrupted midway (minutes of writing at full size) is continued by the same command;
    a directory that holds anything else is the user's and is refused."""
    started = target / _STARTED_MARKER
    if started.exists():
        found = json.loads(started.read_text())
        if found != wanted:
            raise ConfigError(f"{str(target)!r} holds an unfinished random model of other "
                              f"settings ({found}); choose another directory")
        return
    refuse_foreign_directory(target, "a random model")
    target.mkdir(parents=True, exist_ok=True)
    started.write_text(json.dumps(wanted))


def write_pipeline(target: Path, family: str, size: str, *, dtype: str, device: Any, seed: int,
                   components: str,
                   shapes: Mapping[str, ComponentShape] | None = None) -> dict[str, int]:
    """Builds the pipeline and writes it to ``target`` a large component at a time
    (``engine.makers.writing``): each DiT and released-shape component is written as soon as
    it is built and freed before the next, then the rest; returns the parameters per module
    component. ``shapes``: the released components' table (``build_pipeline``'s)."""
    from ditserve.engine.makers.builders import build_pipeline
    from ditserve.engine.makers.writing import save_pipeline, writing_components
    from ditserve.engine.weights.loader import torch_dtype

    target.mkdir(parents=True, exist_ok=True)
    with writing_components(target) as writer:
        pipe = build_pipeline(family, size, dtype=torch_dtype(dtype), device=device, seed=seed,
                              components=components, shapes=shapes)
    save_pipeline(pipe, target, writer.written)
    return _parameters(pipe)


def default_components(size: str) -> str:
    """What ``--components`` means when not given: the whole released pipeline at full
    size, tiny parts around a small or tiny DiT."""
    return "all" if size == "full" else "dit"


def _parameters(pipe: Any) -> dict[str, int]:
    """Parameters per module component of the pipeline."""
    import torch

    return {name: sum(p.numel() for p in module.parameters())
            for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
