"""The Wan 2.x text-to-video family: its record and the models its builders make.

With the rest of its folder, the only place outside the tests that spells Wan's diffusers class names; the torch-side
parts are named lazily: the step pipeline (``engine.families.wan.pipeline``), the sequence-parallel
hooks (``engine.families.wan.sp``) and the random-weight builders (``engine.families.wan.builders``).

Three released layouts share it: Wan2.1-T2V-14B (one DiT: diffusers' defaults, 40 blocks
5120 wide), Wan2.2-T2V-A14B (two such experts switched at ``boundary_ratio``) and
Wan2.2-TI2V-5B (30 blocks 3072 wide on 48 latent channels, a timestep per token).
"""

from __future__ import annotations

from typing import Any

from ditserve.engine.families.base import ComponentShape, Family
from ditserve.engine.families.defaults import pipeline_video

WAN21_SIZES: dict[str, dict[str, Any]] = {
    "full": {},  # diffusers' defaults are Wan2.1-T2V-14B's (and each A14B expert)
    "small": dict(num_layers=2, num_attention_heads=4),
    "tiny": dict(num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=32,
                 ffn_dim=32, num_layers=2, rope_max_seq_len=32),
}
TI2V_SIZES: dict[str, dict[str, Any]] = {
    "full": dict(num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336,
                 num_layers=30),
    "small": dict(num_attention_heads=4, in_channels=48, out_channels=48, ffn_dim=14336,
                  num_layers=2),
    "tiny": dict(num_attention_heads=2, attention_head_dim=12, in_channels=48,
                 out_channels=48, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2,
                 rope_max_seq_len=32),
}
# The released parts around the DiT (the Diffusers repositories' text_encoder and vae
# config.json): UMT5-XXL's encoder (~5.7B parameters, 11.4 GB in bf16; every Wan model) and
# the Wan 2.1 VAE (16 channels, 8x spatial, 4x temporal) or Wan 2.2's (48 channels, 16x
# spatial; its per-channel latents_mean/std are normalization constants, 0 and 1 here).
UMT5_XXL = ComponentShape("transformers", "UMT5EncoderModel", config_class="UMT5Config",
                          config=dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240,
                                      num_layers=24, num_heads=64,
                                      feed_forward_proj="gated-gelu",
                                      relative_attention_num_buckets=32,
                                      relative_attention_max_distance=128,
                                      decoder_start_token_id=0, pad_token_id=0,
                                      eos_token_id=1))
WAN21_VAE = ComponentShape("diffusers", "AutoencoderKLWan", config=dict(
    base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
    temperal_downsample=[False, True, True]))
WAN22_VAE = ComponentShape("diffusers", "AutoencoderKLWan", config=dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
    attn_scales=[], temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
    out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
    latents_mean=[0.0] * 48, latents_std=[1.0] * 48))
WAN21_COMPONENTS = {"text_encoder": UMT5_XXL, "vae": WAN21_VAE}
WAN22_BOUNDARY_RATIO = 0.875  # Wan2.2-T2V-A14B: the high-noise expert runs t >= 875
EXPERTS = "wan2.2"  # the variant with two experts
TI2V = "wan2.2-ti2v"  # the variant with Wan 2.2's VAE and per-token timesteps

WAN = Family(
    name="wan", label="Wan", pipeline_class="WanPipeline",
    pipeline_module="diffusers.pipelines.wan.pipeline_wan",
    dit_class="WanTransformer3DModel", dit_components=("transformer",),
    expert_components=("transformer_2",), expert_switch="boundary_ratio",
    components=("vae", "text_encoder", "tokenizer", "scheduler"),
    block_lists=("blocks",),
    resident_modules=("rope", "patch_embedding", "condition_embedder", "norm_out", "proj_out"),
    output="video",
    loader_version="wan-loader-1", cfg_rows="guidance",
    attention_heads=(12, 24, 40),  # Wan2.1-T2V-1.3B, Wan2.2-TI2V-5B, the 14B DiTs
    reference_work=2 * 21 * 30 * 52,  # 81 frames -> 21 latent frames of 30 x 52 tokens, CFG
    activation_copies=10,  # sliced token math (families.wan.block): 8.5 measured
    step_pipeline="ditserve.engine.families.wan.pipeline:WanStepPipeline",
    sp_hooks="ditserve.engine.families.wan.sp:attach",
    builders="ditserve.engine.families.wan.builders",
    # Wan2.1-T2V-14B, Wan2.2-T2V-A14B (two 14B experts), Wan2.2-TI2V-5B
    dit_sizes={"wan": WAN21_SIZES, EXPERTS: WAN21_SIZES, TI2V: TI2V_SIZES},
    released_components={"wan": WAN21_COMPONENTS, EXPERTS: WAN21_COMPONENTS,
                         TI2V: {"text_encoder": UMT5_XXL, "vae": WAN22_VAE}},
    defaults=pipeline_video,  # WanPipeline's: 832x480, 81 frames (5 s at 16 fps), 50 steps
)
