"""The Wan image-to-video family: its record and the models its builders make.

With the rest of its folder, the only place outside the tests that spells Wan's image-to-video pipeline class; its DiT
is Wan's (``engine.families.wan`` spells that one, and this record takes it from there: a
family derived from another imports only its base's module). The torch-side parts are named
lazily: the step pipeline (``engine.families.wan_i2v.pipeline``), the sequence-parallel hooks (Wan's,
the same DiT) and the random-weight builders (``engine.families.wan_i2v.builders``).

Two released layouts: Wan2.1-I2V-14B-480P (16 noise + 4 mask + 16 condition input channels,
a CLIP ViT-H image context 1280 wide) and Wan2.2-TI2V-5B served as image-to-video (its DiT
unchanged, ``expand_timesteps``, no image encoder).
"""

from __future__ import annotations

from typing import Any

from ditserve.engine.families.base import ComponentShape, Family
from ditserve.engine.families.defaults import pipeline_video
from ditserve.engine.families.wan import (
    TI2V_SIZES,
    UMT5_XXL,
    WAN,
    WAN21_COMPONENTS,
    WAN21_SIZES,
    WAN22_VAE,
)

_I2V = dict(in_channels=36, out_channels=16)
DIT_SIZES: dict[str, dict[str, Any]] = {
    "full": dict(_I2V, image_dim=1280, added_kv_proj_dim=5120),
    "small": dict(_I2V, num_layers=2, num_attention_heads=4, image_dim=1280,
                  added_kv_proj_dim=512),
    "tiny": dict(WAN21_SIZES["tiny"], **_I2V, image_dim=32, added_kv_proj_dim=24),
}
# Wan2.1-I2V-14B-480P's image encoder: CLIP ViT-H/14's vision tower (~630M parameters).
CLIP_VIT_H = ComponentShape("transformers", "CLIPVisionModel", config_class="CLIPVisionConfig",
                            config=dict(hidden_size=1280, intermediate_size=5120,
                                        num_hidden_layers=32, num_attention_heads=16,
                                        image_size=224, patch_size=14, projection_dim=1024,
                                        hidden_act="gelu"))
TI2V_I2V = "wan2.2-ti2v-i2v"  # the variant without an image encoder

WAN_I2V = Family(
    name="wan-i2v", label="WanI2V", pipeline_class="WanImageToVideoPipeline",
    pipeline_module="diffusers.pipelines.wan.pipeline_wan_i2v",
    dit_class=WAN.dit_class, dit_components=WAN.dit_components,
    expert_components=WAN.expert_components, expert_switch=WAN.expert_switch,
    components=WAN.components,  # + image_encoder / image_processor where the model has them
    block_lists=WAN.block_lists, resident_modules=WAN.resident_modules,
    output="video",
    loader_version="wan-i2v-loader-1", cfg_rows="guidance",
    attention_heads=WAN.attention_heads, reference_work=WAN.reference_work,
    activation_copies=WAN.activation_copies,
    step_pipeline="ditserve.engine.families.wan_i2v.pipeline:WanI2VStepPipeline",
    sp_hooks=WAN.sp_hooks,
    builders="ditserve.engine.families.wan_i2v.builders",
    # Wan2.1-I2V-14B-480P; Wan2.2-TI2V-5B as image-to-video
    dit_sizes={"wan-i2v": DIT_SIZES, TI2V_I2V: TI2V_SIZES},
    released_components={"wan-i2v": {**WAN21_COMPONENTS, "image_encoder": CLIP_VIT_H},
                         TI2V_I2V: {"text_encoder": UMT5_XXL, "vae": WAN22_VAE}},
    defaults=pipeline_video,
)
