"""The Wan 2.x text-to-video family: its record and the models its builders make.

The only module outside the tests that spells Wan's diffusers class names; the torch-side
parts are named lazily: the step pipeline (``engine.pipelines.wan``), the sequence-parallel
hooks (``engine.pipelines.wan_sp``) and the random-weight builders (``engine.builders.wan``).

Three released layouts share it: Wan2.1-T2V-14B (one DiT: diffusers' defaults, 40 blocks
5120 wide), Wan2.2-T2V-A14B (two such experts switched at ``boundary_ratio``) and
Wan2.2-TI2V-5B (30 blocks 3072 wide on 48 latent channels, a timestep per token).
"""

from __future__ import annotations

from typing import Any

from ditserve.engine.families.base import Family
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
WAN22_BOUNDARY_RATIO = 0.875  # Wan2.2-T2V-A14B: the high-noise expert runs t >= 875
EXPERTS = "wan2.2"  # the variant with two experts
TI2V = "wan2.2-ti2v"  # the variant with Wan 2.2's VAE and per-token timesteps

WAN = Family(
    name="wan", label="Wan", pipeline_class="WanPipeline",
    dit_class="WanTransformer3DModel", dit_components=("transformer",),
    expert_components=("transformer_2",), expert_switch="boundary_ratio",
    components=("vae", "text_encoder", "tokenizer", "scheduler"),
    block_lists=("blocks",),
    resident_modules=("rope", "patch_embedding", "condition_embedder", "norm_out", "proj_out"),
    batch_key_fields=("height", "width", "num_frames", "max_sequence_length"), output="video",
    loader_version="wan-loader-1", cfg_rows="guidance",
    attention_heads=(12, 24, 40),  # Wan2.1-T2V-1.3B, Wan2.2-TI2V-5B, the 14B DiTs
    reference_work=2 * 21 * 30 * 52,  # 81 frames -> 21 latent frames of 30 x 52 tokens, CFG
    step_pipeline="ditserve.engine.pipelines.wan:WanStepPipeline",
    sp_hooks="ditserve.engine.pipelines.wan_sp:attach",
    builders="ditserve.engine.builders.wan",
    # Wan2.1-T2V-14B, Wan2.2-T2V-A14B (two 14B experts), Wan2.2-TI2V-5B
    dit_sizes={"wan": WAN21_SIZES, EXPERTS: WAN21_SIZES, TI2V: TI2V_SIZES},
    defaults=pipeline_video,  # WanPipeline's: 832x480, 81 frames (5 s at 16 fps), 50 steps
)
