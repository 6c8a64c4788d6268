"""The Qwen-Image-Edit family (image edits on Qwen-Image's DiT): its record and builder shapes.

With the rest of its folder, the only place outside the tests that spells Qwen-Image-Edit's diffusers pipeline class; its
DiT is Qwen-Image's (``engine.families.qwen_image`` spells that one, and this record takes it
from there: a family derived from another imports only its base's module). The torch-side
parts are named lazily: the step pipeline (``engine.families.qwen_image_edit.pipeline``), the
sequence-parallel hooks (Qwen-Image's, the same DiT) and the random-weight builders
(``engine.families.qwen_image_edit.builders``).

Besides Qwen-Image's components a model directory holds ``processor``: Qwen2.5-VL's image
processor and tokenizer, which the prompt encoding reads the source image through. The step
pipeline reads its image-processor settings itself (``preprocessor_config.json``), so the
loader does not build diffusers' ``Qwen2VLProcessor`` (``self_loaded``).
"""

from __future__ import annotations

from ditserve.engine.families.base import Family
from ditserve.engine.families.qwen_image import DIT_SIZES, QWEN_IMAGE, RELEASED_COMPONENTS

QWEN_IMAGE_EDIT = Family(
    name="qwen-image-edit", label="QwenImageEdit", pipeline_class="QwenImageEditPipeline",
    pipeline_module="diffusers.pipelines.qwenimage.pipeline_qwenimage_edit",
    dit_class=QWEN_IMAGE.dit_class, dit_components=QWEN_IMAGE.dit_components,
    components=(*QWEN_IMAGE.components, "processor"), self_loaded=("processor",),
    block_lists=QWEN_IMAGE.block_lists, resident_modules=QWEN_IMAGE.resident_modules,
    output="image",
    loader_version="qwen-image-edit-loader-1", attention_heads=QWEN_IMAGE.attention_heads,
    reference_work=2 * 4096,  # a 1024x1024 edit: 4096 target + 4096 source tokens
    step_pipeline="ditserve.engine.families.qwen_image_edit.pipeline:QwenImageEditStepPipeline",
    sp_hooks=QWEN_IMAGE.sp_hooks,
    builders="ditserve.engine.families.qwen_image_edit.builders",  # both layouts
    dit_sizes={"qwen-image-edit": DIT_SIZES},  # Qwen-Image-Edit: Qwen-Image's 20B DiT
    # Qwen-Image's text encoder (Qwen2.5-VL-7B, its vision tower included) and VAE.
    released_components={"qwen-image-edit": RELEASED_COMPONENTS},
)
