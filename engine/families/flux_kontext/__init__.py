"""The FLUX.1 Kontext family (image editing): its record and the models its builders make.

With the rest of its folder, the only place outside the tests that spells Kontext's diffusers pipeline class; its DiT is
Flux's (``engine.families.flux`` spells that one, and this record takes it from there: a
family derived from another imports only its base's module). The torch-side parts are named
lazily: the step pipeline (``engine.families.flux_kontext.pipeline``), the sequence-parallel hooks
(Flux's, the same DiT) and the random-weight builders (``engine.families.flux_kontext.builders``).
"""

from __future__ import annotations

from ditserve.engine.families.base import Family
from ditserve.engine.families.flux import DIT_SIZES, FLUX, RELEASED_COMPONENTS

FLUX_KONTEXT = Family(
    name="flux-kontext", label="FluxKontext", pipeline_class="FluxKontextPipeline",
    pipeline_module="diffusers.pipelines.flux.pipeline_flux_kontext",
    dit_class=FLUX.dit_class, dit_components=FLUX.dit_components, components=FLUX.components,
    block_lists=FLUX.block_lists, resident_modules=FLUX.resident_modules,
    output="image",
    loader_version="flux-kontext-loader-1", attention_heads=FLUX.attention_heads,
    reference_work=2 * 4096,  # a 1024x1024 edit: 4096 target + 4096 source tokens
    step_pipeline="ditserve.engine.families.flux_kontext.pipeline:FluxKontextStepPipeline",
    sp_hooks=FLUX.sp_hooks,
    builders="ditserve.engine.families.flux_kontext.builders",
    dit_sizes={"flux-kontext": DIT_SIZES},  # FLUX.1-Kontext-dev: Flux.1's DiT
    # Kontext has no image encoder: the source image goes through Flux's VAE.
    released_components={"flux-kontext": RELEASED_COMPONENTS},
)
