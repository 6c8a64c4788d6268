"""The Qwen-Image family (Qwen-Image 20B): its record and the shapes its builders make.

The only module outside the tests that spells Qwen-Image's diffusers class names; the
torch-side parts are named lazily: the step pipeline (``engine.pipelines.qwen_image``), the
sequence-parallel hooks (``engine.pipelines.qwen_image_sp``) and the random-weight builders
(``engine.builders.qwen_image``).
"""

from __future__ import annotations

from typing import Any

from ditserve.engine.families.base import Family

# The DiT's keyword arguments per size: "full" is the class defaults, i.e. the released
# 20B DiT (60 blocks, 24 heads x 128); "small" keeps the widths with two blocks.
DIT_SIZES: dict[str, dict[str, Any]] = {
    "full": {},
    "small": dict(num_layers=2, num_attention_heads=4),
    "tiny": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2,
                 joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
}

QWEN_IMAGE = Family(
    name="qwen-image", label="QwenImage", pipeline_class="QwenImagePipeline",
    dit_class="QwenImageTransformer2DModel", dit_components=("transformer",),
    components=("vae", "text_encoder", "tokenizer", "scheduler"),
    block_lists=("transformer_blocks",),
    resident_modules=("pos_embed", "time_text_embed", "txt_norm", "img_in", "txt_in",
                      "norm_out", "proj_out"),
    batch_key_fields=("height", "width", "max_sequence_length"), output="image",
    loader_version="qwen-image-loader-1",
    attention_heads=(24,),  # Qwen-Image 20B
    step_pipeline="ditserve.engine.pipelines.qwen_image:QwenImageStepPipeline",
    sp_hooks="ditserve.engine.pipelines.qwen_image_sp:attach",
    builders="ditserve.engine.builders.qwen_image",
    dit_sizes={"qwen-image": DIT_SIZES},  # Qwen-Image (20B)
)
