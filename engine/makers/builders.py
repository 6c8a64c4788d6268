"""Random-weight diffusers pipelines of every family, at a chosen DiT size.

Everything is built locally from a seed; nothing is downloaded. The DiT has the size asked
for - its keyword arguments are the family record's ``dit_sizes`` (``engine.families``):
``full`` is the released model's architecture, ``small`` keeps the full widths with two
blocks and few heads (CPU checks) and ``tiny`` is a few hundred kilobytes (tests,
``ditserve model init-tiny``). Around the DiT, ``components`` chooses:

- ``"dit"``: deliberately tiny parts - text encoders of one or two layers whose output width
  is what the DiT expects, VAEs with the family's latent layout and a few channels - so the
  DiT, the part offload streams and batching amortizes, is the only large part;
- ``"all"``: every text encoder, image encoder and VAE at its released shape (the family
  record's ``released_components`` table, or ``shapes`` when given: tests pass scaled-down
  tables), built by ``engine.makers.released``.

Tokenizers are built from an in-code vocabulary either way. Those parts are each family's
own builder module (``Family.builders``, e.g. ``engine.families.wan.builders``). Every module is left
on ``device``; inside ``engine.makers.writing.writing_components`` (``init_random``), each large
one - a DiT, a released-shape component - is written as soon as it is built and emptied, so
the next is built in the memory it held.

Called by ``tiny_model.init_tiny`` and ``random_model.init_random``; the bench builds DiTs
in memory with ``make_dit``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.errors import ConfigError
from ditserve.engine.families import MODEL_VARIANTS, Family, family_of_variant, resolve
from ditserve.engine.families.base import ComponentShape

VARIANTS: tuple[str, ...] = tuple(MODEL_VARIANTS)
SIZES = ("tiny", "small", "full")
# What init-random builds at released shape: every component, or the DiT alone (tiny parts).
COMPONENTS = ("all", "dit")
# The tokenizers' model_max_length: the released models' 512 at every size, so a tiny model
# encodes prompts exactly as the released pipeline's defaults do (max_sequence_length 512).
TEXT_TOKENS = 512


def _family(variant: str) -> Family:
    family = family_of_variant(variant)
    if family is None:
        raise ConfigError(f"family must be one of {', '.join(VARIANTS)}, got {variant!r}")
    return family


def check(variant: str, size: str, components: str = "dit") -> None:
    _family(variant)
    if size not in SIZES:
        raise ConfigError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    if components not in COMPONENTS:
        raise ConfigError(f"components must be one of {', '.join(COMPONENTS)}, "
                          f"got {components!r}")


def released_shapes(variant: str) -> Mapping[str, ComponentShape]:
    """The variant's text encoders, image encoder and VAE at their released shapes."""
    return _family(variant).released_components[variant]


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


def make_dit(variant: str, size: str, *, dtype: Any, device: Any, seed: int,
             component: str = "transformer") -> Any:
    """One random DiT on ``device``, allocated and initialized in ``dtype`` there (so a full
    one never needs a float32 copy), in the dtypes an ordinary load gives: the class's
    keep-in-float32 modules (Wan's norms and modulation tables) in float32. ``component``:
    its name in the pipeline (a second DiT's is another), under which ``init-random`` writes
    it as soon as it is built (``engine.makers.writing``)."""
    import torch

    from ditserve.engine.makers.released import allocating
    from ditserve.engine.makers.writing import finished
    from ditserve.engine.weights.loader import keeps_float32

    torch.manual_seed(seed)
    cls = dit_class(variant)
    with allocating(dtype, device):
        model = cls(**dit_config(variant, size))
    for name, p in model.named_parameters():
        if keeps_float32(cls, name) and p.is_floating_point():
            p.data = p.data.float()
    return finished(component, model.eval().requires_grad_(False))


def build_pipeline(variant: str, size: str, *, dtype: Any, device: Any, seed: int,
                   components: str = "dit",
                   shapes: Mapping[str, ComponentShape] | None = None) -> Any:
    """The variant's whole diffusers pipeline object (not saved), by its family's builder;
    ``components``/``shapes``: see the module docstring."""
    check(variant, size, components)
    released = None
    if components == "all":
        if shapes is None and size == "tiny":
            raise ConfigError("a tiny DiT takes tiny text encoders; --components all builds "
                              "the released ones: use --size small or full")
        released = dict(released_shapes(variant) if shapes is None else shapes)
    builders = resolve(_family(variant).builders)
    return builders.build_pipeline(variant, size, dtype=dtype, device=device, seed=seed,
                                   released=released)


def build_tiny(variant: str, seed: int) -> Any:
    """The variant's tiny pipeline (what ``ditserve model init-tiny`` writes), float32."""
    builders = resolve(_family(variant).builders)
    return builders.build_tiny(variant, seed)
