"""The Flux family (FLUX.1-dev / schnell): its record and the shapes its builders make.

With the rest of its folder, the only place outside the tests that spells Flux's diffusers class names; the torch-side
parts are named lazily: the step pipeline (``engine.families.flux.pipeline``), the sequence-parallel
hooks (``engine.families.flux.sp``) and the random-weight builders (``engine.families.flux.builders``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.families.base import ComponentShape, Family
from ditserve.engine.families.defaults import ModelDefaults, image_side

_ROPE = (16, 56, 56)
# The DiT's keyword arguments per size. "full" is diffusers' default config (that of
# FLUX.1-dev, 19 double + 38 single blocks, 3072 wide, ~11.9B parameters) with the guidance
# embedding on; "small" keeps the widths with 2 + 4 blocks and 4 heads; "tiny" is a few MB.
DIT_SIZES: dict[str, dict[str, Any]] = {
    "full": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                 attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                 pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=_ROPE),
    "small": dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4,
                  attention_head_dim=128, num_attention_heads=4, joint_attention_dim=4096,
                  pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=_ROPE),
    "tiny": dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2,
                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                 pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6)),
}
# The embedded default model's DiT (``ditserve model init-tiny``; 4 latent channels).
TINY_DIT: dict[str, Any] = dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
    axes_dims_rope=(4, 6, 6), guidance_embeds=True,
)
# The released parts around the DiT (FLUX.1-dev's text_encoder, text_encoder_2 and vae
# config.json): CLIP ViT-L/14's text tower, T5 v1.1 XXL's encoder (~4.8B parameters, 9.5 GB
# in bf16) and Flux's 16-channel VAE. ``init-random --components all`` builds these.
RELEASED_COMPONENTS: dict[str, ComponentShape] = {
    "text_encoder": ComponentShape("transformers", "CLIPTextModel", config_class="CLIPTextConfig",
                                   config=dict(vocab_size=49408, hidden_size=768,
                                               intermediate_size=3072, num_hidden_layers=12,
                                               num_attention_heads=12, max_position_embeddings=77,
                                               hidden_act="quick_gelu", projection_dim=768)),
    "text_encoder_2": ComponentShape("transformers", "T5EncoderModel", config_class="T5Config",
                                     config=dict(vocab_size=32128, d_model=4096, d_kv=64,
                                                 d_ff=10240, num_layers=24, num_heads=64,
                                                 feed_forward_proj="gated-gelu",
                                                 relative_attention_num_buckets=32,
                                                 relative_attention_max_distance=128,
                                                 decoder_start_token_id=0, pad_token_id=0,
                                                 eos_token_id=1)),
    "vae": ComponentShape("diffusers", "AutoencoderKL", config=dict(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
        layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
        use_post_quant_conv=False)),
}
DISTILLED_STEPS = 4  # schnell: timestep-distilled, no guidance embedding


def defaults(dit: Mapping[str, Any], vae: Mapping[str, Any],
             call: Mapping[str, Any]) -> ModelDefaults:
    """A square of the VAE's size; 4 steps for a distilled model (schnell), else the
    pipeline's own (28, FLUX.1-dev)."""
    side = image_side(vae)
    distilled = dit.get("guidance_embeds") is False
    return ModelDefaults(side, side,
                         DISTILLED_STEPS if distilled else int(call["num_inference_steps"]))


FLUX = Family(
    name="flux", label="Flux", pipeline_class="FluxPipeline",
    pipeline_module="diffusers.pipelines.flux.pipeline_flux",
    dit_class="FluxTransformer2DModel", dit_components=("transformer",),
    components=("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
                "scheduler"),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    resident_modules=("pos_embed", "time_text_embed", "context_embedder", "x_embedder",
                      "norm_out", "proj_out"),
    output="image",
    loader_version="flux-loader-1",
    attention_heads=(24,),  # FLUX.1-dev / schnell
    step_pipeline="ditserve.engine.families.flux.pipeline:FluxStepPipeline",
    sp_hooks="ditserve.engine.families.flux.sp:attach",
    builders="ditserve.engine.families.flux.builders",
    dit_sizes={"flux": DIT_SIZES},  # FLUX.1-dev
    released_components={"flux": RELEASED_COMPONENTS},
    defaults=defaults,
)
