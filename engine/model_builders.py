"""Random-weight diffusers pipelines of every family, at a chosen DiT size.

Everything is built locally from a seed; nothing is downloaded. The DiT has the size asked
for - its keyword arguments are the family record's ``dit_sizes`` (``engine.families``):
``full`` is the released model's architecture, ``small`` keeps the full widths with two
blocks and few heads (CPU checks) and ``tiny`` is a few hundred kilobytes (tests,
``ditserve model init-tiny``). Around the DiT everything is deliberately tiny - text
encoders of one or two layers whose output width is what the DiT expects, tokenizers built
from an in-code vocabulary, VAEs with the family's latent layout and a few channels - so the
DiT, the part offload streams and batching amortizes, is the only large part. Those parts
are each family's own builder module (``Family.builders``, e.g. ``engine.builders.wan``).

Called by ``tiny_model.init_tiny`` and ``random_model.init_random``; the bench builds DiTs
in memory with ``make_dit``.
"""

from __future__ import annotations

from typing import Any

from ditserve.engine.errors import ConfigError
from ditserve.engine.families import MODEL_VARIANTS, Family, family_of_variant, resolve

VARIANTS: tuple[str, ...] = tuple(MODEL_VARIANTS)
SIZES = ("tiny", "small", "full")
# The tokenizers' model_max_length: the released models' 512 at every size, so a tiny model
# encodes prompts exactly as the released pipeline's defaults do (max_sequence_length 512).
TEXT_TOKENS = 512


def _family(variant: str) -> Family:
    family = family_of_variant(variant)
    if family is None:
        raise ConfigError(f"family must be one of {', '.join(VARIANTS)}, got {variant!r}")
    return family


def check(variant: str, size: str) -> None:
    _family(variant)
    if size not in SIZES:
        raise ConfigError(f"size must be one of {', '.join(SIZES)}, got {size!r}")


def dit_class(variant: str) -> Any:
    """The diffusers class of the variant's DiT (the family's ``dit_class``)."""
    import diffusers

    return getattr(diffusers, _family(variant).dit_class)


def dit_config(variant: str, size: str) -> dict[str, Any]:
    """The DiT's keyword arguments (full size: mostly the class defaults, i.e. the released
    model)."""
    check(variant, size)
    return dict(_family(variant).dit_sizes[variant][size])


def dit_setting(variant: str, size: str, name: str) -> Any:
    """One setting of the variant's DiT at ``size``: given, else the class default."""
    import inspect

    config = dit_config(variant, size)
    if name in config:
        return config[name]
    return inspect.signature(dit_class(variant).__init__).parameters[name].default


def make_dit(variant: str, size: str, *, dtype: Any, device: Any, seed: int) -> Any:
    """One random DiT on ``device``, allocated and initialized in ``dtype`` there (so a full
    one never needs a float32 copy), in the dtypes an ordinary load gives: the class's
    keep-in-float32 modules (Wan's norms and modulation tables) in float32."""
    import torch

    from ditserve.engine.weights.loader import keeps_float32

    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            cls = dit_class(variant)
            model = cls(**dit_config(variant, size))
    finally:
        torch.set_default_dtype(previous)
    for name, p in model.named_parameters():
        if keeps_float32(cls, name) and p.is_floating_point():
            p.data = p.data.float()
    return model.eval().requires_grad_(False)


def build_dit(variant: str, size: str, *, dtype: Any, device: Any, seed: int) -> Any:
    """``make_dit``, returned on the CPU (what the builders save)."""
    return make_dit(variant, size, dtype=dtype, device=device, seed=seed).to(device="cpu")


def build_pipeline(variant: str, size: str, *, dtype: Any, device: Any, seed: int) -> Any:
    """The variant's whole diffusers pipeline object (not saved), by its family's builder."""
    check(variant, size)
    builders = resolve(_family(variant).builders)
    return builders.build_pipeline(variant, size, dtype=dtype, device=device, seed=seed)


def build_tiny(variant: str, seed: int) -> Any:
    """The variant's tiny pipeline (what ``ditserve model init-tiny`` writes), float32."""
    builders = resolve(_family(variant).builders)
    return builders.build_tiny(variant, seed)
