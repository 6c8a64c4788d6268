"""The model families ditserve serves: the registry of their records (pure; no torch).

Each family lives in its own folder (``flux``, ``qwen_image``, ``wan``, ``z_image``,
``flux2``, ``cosmos3``, ``minimax_h3``, and the derived ``flux_kontext``, ``qwen_image_edit``,
``qwen_image_edit_plus``, ``wan_i2v`` and ``flux2_klein``) as one ``Family``
record (``base``): its layout, DiT block lists, batch key fields, server defaults, builder
shapes, and lazy references to its torch-side step pipeline, sequence-parallel hooks and
builders. This module lists them and answers the lookups everything else makes: by CLI name
or operator label, by ``model_index.json``'s ``_class_name``, by DiT class name, by builder
variant.

Read by the option rules (``engine.config``: which ``model.family`` values the operator
accepts), the loader (layout checks, DiT components), offload discovery and FP8 selection
(declared block lists), sequence parallelism (hooks), the model builders, the server's
defaults and the torch-side pipeline registry (``engine.pipelines.registry``).
Adding a family: docs/architecture.md, "Adding a family".
"""

from __future__ import annotations

from ditserve.engine.families.base import Family, resolve
from ditserve.engine.families.cosmos3 import COSMOS3
from ditserve.engine.families.flux import FLUX
from ditserve.engine.families.flux2 import FLUX2
from ditserve.engine.families.flux2_klein import FLUX2_KLEIN
from ditserve.engine.families.flux_kontext import FLUX_KONTEXT
from ditserve.engine.families.minimax_h3 import MINIMAX_H3
from ditserve.engine.families.qwen_image import QWEN_IMAGE
from ditserve.engine.families.qwen_image_edit import QWEN_IMAGE_EDIT
from ditserve.engine.families.qwen_image_edit_plus import QWEN_IMAGE_EDIT_PLUS
from ditserve.engine.families.wan import WAN
from ditserve.engine.families.wan_i2v import WAN_I2V
from ditserve.engine.families.z_image import Z_IMAGE

# Text-to-image/video families first, then the image-conditioned ones derived from them (the
# same DiTs; a derived family comes after its base, which spells the DiT's class name).
FAMILIES: tuple[Family, ...] = (FLUX, QWEN_IMAGE, WAN, Z_IMAGE, FLUX2, COSMOS3, MINIMAX_H3,
                                FLUX_KONTEXT,
                                QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS, WAN_I2V, FLUX2_KLEIN)
# What the model builders (`ditserve model init-tiny / init-random --family`) build: one
# released model layout each, by the family it belongs to (each family's ``dit_sizes``).
MODEL_VARIANTS: dict[str, str] = {v: f.name for f in FAMILIES for v in f.variants}
# The value of ``model.family`` that means "read it from model_index.json".
AUTO_FAMILY = "Auto"

__all__ = ["AUTO_FAMILY", "COSMOS3", "FAMILIES", "FLUX", "FLUX2", "FLUX2_KLEIN", "FLUX_KONTEXT", "MINIMAX_H3", "MODEL_VARIANTS", "QWEN_IMAGE",
           "QWEN_IMAGE_EDIT", "QWEN_IMAGE_EDIT_PLUS", "WAN", "WAN_I2V", "Z_IMAGE", "Family",
           "declared_block_lists", "family_labels", "family_named", "family_names",
           "family_of_dit", "family_of_pipeline", "family_of_variant", "resolve",
           "supported_pipelines"]


def family_names() -> tuple[str, ...]:
    return tuple(f.name for f in FAMILIES)


def family_labels() -> tuple[str, ...]:
    return tuple(f.label for f in FAMILIES)


def family_named(name: str) -> Family | None:
    """The family a CLI name or operator label names (case-insensitive), else None."""
    wanted = name.strip().lower()
    for family in FAMILIES:
        if wanted in (family.name, family.label.lower()):
            return family
    return None


def family_of_pipeline(class_name: object) -> Family | None:
    """The family whose layout ``model_index.json``'s ``_class_name`` names, else None."""
    for family in FAMILIES:
        if family.pipeline_class == class_name:
            return family
    return None


def family_of_dit(dit_class: str) -> Family | None:
    """The family whose DiT class has this name, else None."""
    for family in FAMILIES:
        if family.dit_class == dit_class:
            return family
    return None


def family_of_variant(variant: str) -> Family | None:
    """The family that builds a model variant (``MODEL_VARIANTS``), else None."""
    name = MODEL_VARIANTS.get(variant)
    return None if name is None else family_named(name)


def supported_pipelines() -> tuple[str, ...]:
    return tuple(f.pipeline_class for f in FAMILIES)


def declared_block_lists(dit_class: str) -> tuple[str, ...] | None:
    """The block lists a family declares for a DiT class (by class name), else None."""
    family = family_of_dit(dit_class)
    return None if family is None else family.block_lists
