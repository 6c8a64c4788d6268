"""The FLUX.2 [dev] family: its record and the shapes its builders make.

With the rest of its folder, the only place outside the tests that spells FLUX.2's diffusers
class names. FLUX.2 [dev] is a 32B DiT (8 double-stream + 48 single-stream blocks, 6144
wide, a guidance embedding) whose text encoder is Mistral-Small-3.1 (24B): the prompt is the
stack of three of its hidden layers (10, 20, 30). Reference images (multi-reference editing)
are VAE-encoded and appended after the target's tokens. The torch-side parts are named
lazily: the step pipeline (``engine.families.flux2.pipeline``), the sequence-parallel hooks
(``engine.families.flux2.sp``) and the random-weight builders
(``engine.families.flux2.builders``). FLUX.2 [klein] (``engine.families.flux2_klein``) is
the same DiT with a Qwen3 encoder.
"""

from __future__ import annotations

from typing import Any

from ditserve.engine.families.base import ComponentShape, Family

_ROPE_TINY = (4, 4, 4, 4)
# The DiT's keyword arguments per size. "full" is diffusers' default config (that of
# FLUX.2-dev: 8 double + 48 single blocks, 48 heads of 128, 15360-wide text input = three
# stacked 5120-wide Mistral layers, ~32.2B parameters); "small" keeps the widths with 1 + 2
# blocks and 4 heads; "tiny" is a few hundred kB (48-wide text input = 3 x 16).
DIT_SIZES: dict[str, dict[str, Any]] = {
    "full": dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48,
                 attention_head_dim=128, num_attention_heads=48, joint_attention_dim=15360,
                 timestep_guidance_channels=256, mlp_ratio=3.0,
                 axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=True),
    "small": dict(patch_size=1, in_channels=128, num_layers=1, num_single_layers=2,
                  attention_head_dim=128, num_attention_heads=4, joint_attention_dim=15360,
                  axes_dims_rope=(32, 32, 32, 32), guidance_embeds=True),
    "tiny": dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                 timestep_guidance_channels=32, axes_dims_rope=_ROPE_TINY,
                 guidance_embeds=True),
}
# Mistral-Small-3.1-24B's text model (what FLUX.2-dev's text_encoder config.json holds) and
# its Pixtral vision tower (loaded with the encoder, never run by the pipeline's encode).
MISTRAL_TEXT = dict(model_type="mistral", vocab_size=131072, hidden_size=5120,
                    intermediate_size=32768, num_hidden_layers=40, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                    rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000000.0})
PIXTRAL_VISION = dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096,
                      num_hidden_layers=24, num_attention_heads=16, head_dim=64,
                      image_size=1540, patch_size=14, num_channels=3,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# FLUX.2's VAE: 32 latent channels, 8x downsampling, a batch norm over the 2x2-patchified
# latents (128 channels) that the pipeline applies by hand.
VAE = ComponentShape("diffusers", "AutoencoderKLFlux2", config=dict(
    in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
    layers_per_block=2, latent_channels=32, norm_num_groups=32, sample_size=1024,
    use_quant_conv=True, use_post_quant_conv=True, batch_norm_eps=1e-4, patch_size=[2, 2]))
RELEASED_COMPONENTS: dict[str, ComponentShape] = {
    "text_encoder": ComponentShape(
        "transformers", "Mistral3ForConditionalGeneration", config_class="Mistral3Config",
        config=dict(text_config=MISTRAL_TEXT, vision_config=PIXTRAL_VISION,
                    image_token_index=10, projector_hidden_act="gelu", spatial_merge_size=2,
                    multimodal_projector_bias=False, vision_feature_layer=-1,
                    tie_word_embeddings=False)),
    "vae": VAE,
}
# The encoder layers whose hidden states make the prompt (the pipeline's call default).
TEXT_LAYERS = (10, 20, 30)


FLUX2 = Family(
    name="flux2", label="Flux2", pipeline_class="Flux2Pipeline",
    pipeline_module="diffusers.pipelines.flux2.pipeline_flux2",
    dit_class="Flux2Transformer2DModel", dit_components=("transformer",),
    components=("vae", "text_encoder", "tokenizer", "scheduler"),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    resident_modules=("pos_embed", "time_guidance_embed", "double_stream_modulation_img",
                      "double_stream_modulation_txt", "single_stream_modulation",
                      "x_embedder", "context_embedder", "norm_out", "proj_out"),
    output="image",
    loader_version="flux2-loader-1",
    attention_heads=(48,),  # FLUX.2-dev
    step_pipeline="ditserve.engine.families.flux2.pipeline:Flux2StepPipeline",
    sp_hooks="ditserve.engine.families.flux2.sp:attach",
    builders="ditserve.engine.families.flux2.builders",
    dit_sizes={"flux2": DIT_SIZES},
    released_components={"flux2": RELEASED_COMPONENTS},
)
