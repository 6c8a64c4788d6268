"""The Qwen-Image-Edit Plus family (edits from several images, Qwen-Image-Edit-2509 and later):
its record and builder shapes.

With the rest of its folder, the only place outside the tests that spells the multi-image edit pipeline class; its DiT
is Qwen-Image's (``engine.families.qwen_image``) and everything else is Qwen-Image-Edit's
(``engine.families.qwen_image_edit``) but the step pipeline
(``engine.families.qwen_image_edit.pipeline:QwenImageEditPlusStepPipeline``): each image is read by
Qwen2.5-VL at about 384x384 and VAE-encoded at about 1024x1024, and every image's latent
tokens follow the target's.
"""

from __future__ import annotations

import dataclasses

from ditserve.engine.families.base import Family
from ditserve.engine.families.qwen_image import QWEN_IMAGE
from ditserve.engine.families.qwen_image_edit import QWEN_IMAGE_EDIT

QWEN_IMAGE_EDIT_PLUS: Family = dataclasses.replace(
    QWEN_IMAGE_EDIT, name="qwen-image-edit-plus", label="QwenImageEditPlus",
    pipeline_class="QwenImageEditPlusPipeline",
    pipeline_module="diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus",
    loader_version="qwen-image-edit-plus-loader-1",
    step_pipeline="ditserve.engine.families.qwen_image_edit.pipeline:QwenImageEditPlusStepPipeline",
    dit_sizes={"qwen-image-edit-plus": QWEN_IMAGE.dit_sizes["qwen-image"]},
    released_components={"qwen-image-edit-plus": QWEN_IMAGE.released_components["qwen-image"]},
)
