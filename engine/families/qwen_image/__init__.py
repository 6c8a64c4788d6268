"""The Qwen-Image family (Qwen-Image 20B): its record and the shapes its builders make.

With the rest of its folder, the only place outside the tests that spells Qwen-Image's diffusers class names; the
torch-side parts are named lazily: the step pipeline (``engine.families.qwen_image.pipeline``), the
sequence-parallel hooks (``engine.families.qwen_image.sp``) and the random-weight builders
(``engine.families.qwen_image.builders``).
"""

from __future__ import annotations

from typing import Any

from ditserve.engine.families.base import ComponentShape, Family

# The DiT's keyword arguments per size: "full" is the class defaults, i.e. the released
# 20B DiT (60 blocks, 24 heads x 128); "small" keeps the widths with two blocks.
DIT_SIZES: dict[str, dict[str, Any]] = {
    "full": {},
    "small": dict(num_layers=2, num_attention_heads=4),
    "tiny": dict(num_layers=2, attention_head_dim=16, num_attention_heads=2,
                 joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
}

# The released parts around the DiT (Qwen-Image's text_encoder and vae config.json):
# Qwen2.5-VL-7B-Instruct whole (its 28-layer language model and its 32-layer vision tower;
# ~8.3B parameters, 16.6 GB in bf16; the pipeline runs the language model) and the
# Qwen-Image VAE. ``init-random --components all`` builds these.
RELEASED_COMPONENTS: dict[str, ComponentShape] = {
    "text_encoder": ComponentShape(
        "transformers", "Qwen2_5_VLForConditionalGeneration", config_class="Qwen2_5_VLConfig",
        config=dict(
            text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                             num_hidden_layers=28, num_attention_heads=28,
                             num_key_value_heads=4, max_position_embeddings=128000,
                             rms_norm_eps=1e-6,
                             rope_parameters={"rope_type": "default",
                                              "mrope_section": [16, 24, 24],
                                              "rope_theta": 1000000.0}),
            vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                               out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                               temporal_patch_size=2, window_size=112,
                               fullatt_block_indexes=[7, 15, 23, 31]),
            tie_word_embeddings=False)),
    "vae": ComponentShape("diffusers", "AutoencoderKLQwenImage", config=dict(
        base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
        temperal_downsample=[False, True, True])),
}

QWEN_IMAGE = Family(
    name="qwen-image", label="QwenImage", pipeline_class="QwenImagePipeline",
    pipeline_module="diffusers.pipelines.qwenimage.pipeline_qwenimage",
    dit_class="QwenImageTransformer2DModel", dit_components=("transformer",),
    components=("vae", "text_encoder", "tokenizer", "scheduler"),
    block_lists=("transformer_blocks",),
    resident_modules=("pos_embed", "time_text_embed", "txt_norm", "img_in", "txt_in",
                      "norm_out", "proj_out"),
    output="image",
    loader_version="qwen-image-loader-1",
    attention_heads=(24,),  # Qwen-Image 20B
    step_pipeline="ditserve.engine.families.qwen_image.pipeline:QwenImageStepPipeline",
    sp_hooks="ditserve.engine.families.qwen_image.sp:attach",
    builders="ditserve.engine.families.qwen_image.builders",
    dit_sizes={"qwen-image": DIT_SIZES},  # Qwen-Image (20B)
    released_components={"qwen-image": RELEASED_COMPONENTS},
)
