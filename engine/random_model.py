"""Random-weight pipelines at chosen DiT sizes, for benchmarks (`ditserve model init-random`).

Every variant of ``engine.families.MODEL_VARIANTS``, built by its family's builder module
(``engine.model_builders``): the DiT has the family's shapes at the size asked for, next to
deliberately tiny text encoders (their output widths match what the DiT expects) and a tiny
VAE with the family's latent layout. The DiT - the part DLO streams and batching amortizes -
is full size; everything around it costs next to nothing. For Flux, ``init_random(dir,
family="flux", size="full")`` writes a diffusers directory whose DiT is FLUX.1-dev's
architecture (19 double + 38 single blocks, 3072 wide, ~11.9B parameters, guidance
embedding on) next to tiny CLIP and T5 encoders and a VAE with Flux's latent layout (16
channels, 8x downsampling: 1024x1024 pixels -> 4096 image tokens).

Sizes: ``full`` (the real DiT, ~24 GB in bfloat16 for Flux), ``small`` (the same widths with
two or a few blocks and 4 heads: for CPU checks) and ``tiny`` (a few MB).

Building ``full`` allocates every parameter once, on ``device``: on a GPU it takes seconds;
on a CPU it needs the DiT's size in free RAM and minutes of random initialization. Writing
the directory needs as much disk. Weights are never downloaded.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from ditserve.engine.errors import ConfigError
from ditserve.engine.families import MODEL_VARIANTS

log = logging.getLogger(__name__)

FAMILIES = tuple(MODEL_VARIANTS)
SIZES = ("tiny", "small", "full")
_COMPLETE_MARKER = ".ditserve-random-complete"


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
) -> Path:
    """Write the pipeline directory (see module docstring); idempotent once complete."""
    if family not in FAMILIES:
        raise ConfigError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if size not in SIZES:
        raise ConfigError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    target = Path(path)
    marker = target / _COMPLETE_MARKER
    wanted = {"family": family, "size": size, "dtype": dtype, "seed": seed,
              "random_weights": True}
    if marker.exists():
        found = json.loads(marker.read_text())
        if found != wanted:
            raise ConfigError(f"{str(target)!r} already holds a different random model "
                              f"({found}); choose another directory")
        return target
    from ditserve.engine.weights.loader import torch_dtype as to_torch_dtype

    started = time.perf_counter()
    pipe = _build(family, size, dtype=to_torch_dtype(dtype), device=_resolve_device(device),
                  seed=seed)
    params = sum(p.numel() for name in ("transformer", "transformer_2")
                 if getattr(pipe, name, None) is not None
                 for p in getattr(pipe, name).parameters())
    log.info("built a random %s-size %s pipeline: %.2fB DiT parameters in %.1fs", size, family,
             params / 1e9, time.perf_counter() - started)
    target.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(target, max_shard_size="5GB")
    marker.write_text(json.dumps({**wanted, "transformer_parameters": params}))
    log.info("wrote %s in %.1fs", target, time.perf_counter() - started)
    return target


def _build(family: str, size: str, *, dtype: Any, device: Any, seed: int) -> Any:
    from ditserve.engine.model_builders import build_pipeline

    return build_pipeline(family, size, dtype=dtype, device=device, seed=seed)
