"""The NVIDIA Cosmos3 family (Cosmos3 Omni: text-to-video, text-to-image, image-to-video, with
an optional sound track): its record and the shapes its builders make.

With the rest of its folder, the only place outside the tests that spells Cosmos3's diffusers
class names; the torch-side parts are named lazily: the step pipeline
(``engine.families.cosmos3.pipeline``), the sequence-parallel hooks
(``engine.families.cosmos3.sp``) and the random-weight builders
(``engine.families.cosmos3.builders``).

The DiT is a vision-language backbone in a mixture-of-transformers layout: every decoder layer
holds two copies of its weights, one for the prompt's tokens (causal attention, the
"understanding" pathway) and one for the generated tokens (vision and sound latents; full
attention over the prompt and themselves). It reads the prompt's token ids itself (its own
token table), so the family has no text encoder; the VAE is Wan 2.2's (48 channels, 16x
spatial, 4x temporal), the scheduler UniPC.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.families.base import ComponentShape, Family
from ditserve.engine.families.defaults import ModelDefaults

# Cosmos3-Nano is diffusers' default config: a Qwen3-VL-8B-shaped text backbone (36 layers,
# 4096 wide, 32 query / 8 key-value heads of 128) in the two-pathway layout, ~15.2B
# parameters (30.4 GB in bf16; both token tables included).
NANO: dict[str, Any] = {}
# Cosmos3-Super (~124 GB in bf16): its config is not published with diffusers; the nearest
# documented shape is the same layout on Qwen3-VL-32B's text backbone (64 layers, 5120 wide,
# 64 query / 8 key-value heads of 128, MLP 25600): ~64B parameters, ~128 GB in bf16.
SUPER: dict[str, Any] = dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                             num_attention_heads=64, num_key_value_heads=8)
# A few MB: 2 layers 32 wide, 4 query / 2 key-value heads (SP2 splits both), sound
# generation on (the tiny sound tokenizer's 8 channels).
TINY: dict[str, Any] = dict(vocab_size=260, head_dim=16, hidden_size=32, intermediate_size=37,
                            num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2,
                            rope_axes_dim=[4, 2, 2], sound_gen=True, sound_dim=8,
                            sound_latent_fps=25.0)
SMALL_LAYERS = 2
SUPER_VARIANT = "cosmos3-super"

# The Wan 2.2 VAE every Cosmos3 model decodes with (its per-channel statistics are
# normalization constants: 0 and 1 here).
WAN22_VAE = ComponentShape("diffusers", "AutoencoderKLWan", config=dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
    attn_scales=[], temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
    out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
    latents_mean=[0.0] * 48, latents_std=[1.0] * 48))

FPS = 24  # the frame rate Cosmos3 generates at (its pipeline's default ``fps``)


def cosmos3_defaults(dit: Mapping[str, Any], vae: Mapping[str, Any],
                     call: Mapping[str, Any]) -> ModelDefaults:
    """Cosmos3OmniPipeline's own defaults, which its ``__call__`` fills in inside (its
    signature says None): 1280x720, 189 frames at 24 fps, the call's step count and CFG."""
    return ModelDefaults(1280, 720, int(call["num_inference_steps"]), output="video",
                         frames=189, fps=FPS, guidance=float(call["guidance_scale"]))


COSMOS3 = Family(
    name="cosmos3", label="Cosmos3", pipeline_class="Cosmos3OmniPipeline",
    pipeline_module="diffusers.pipelines.cosmos.pipeline_cosmos3_omni",
    dit_class="Cosmos3OmniTransformer", dit_components=("transformer",),
    components=("vae", "text_tokenizer", "scheduler"),  # + sound_tokenizer where it has sound
    # The safety checker (the cosmos_guardrail package) is not part of ditserve: off, and
    # never loaded, whatever model_index.json says.
    load_options={"safety_checker": None, "enable_safety_checker": False},
    block_lists=("layers",),
    # embed_tokens (the prompt's token table) stays in host memory, lm_head (never used to
    # generate) too: the pipeline lists them (``host_modules``).
    resident_modules=("norm", "norm_moe_gen", "rotary_emb", "proj_in", "proj_out",
                      "time_proj", "time_embedder"),
    output="video",
    # Text-to-image is the pipeline's num_frames=1 call: served as a PNG by the image route.
    still_images=True,
    loader_version="cosmos3-loader-1", cfg_rows="guidance",
    # Ulysses splits the key-value heads too: 8 in both DiTs (32 and 64 query heads), so 8
    # bounds the SP size (the SP hooks refuse a size that does not divide them).
    attention_heads=(8,),
    # 189 frames at 1280x720: 48 latent frames of 22 x 40 32-px tokens as the work rule
    # counts them (the DiT pads 45 latent rows to 23 patches), CFG's two passes.
    reference_work=2 * 48 * 22 * 40,
    activation_copies=20,
    step_pipeline="ditserve.engine.families.cosmos3.pipeline:Cosmos3StepPipeline",
    sp_hooks="ditserve.engine.families.cosmos3.sp:attach",
    builders="ditserve.engine.families.cosmos3.builders",
    dit_sizes={"cosmos3": {"full": NANO, "small": dict(num_hidden_layers=SMALL_LAYERS),
                           "tiny": TINY},
               SUPER_VARIANT: {"full": SUPER,
                               "small": dict(SUPER, num_hidden_layers=SMALL_LAYERS),
                               "tiny": TINY}},
    released_components={"cosmos3": {"vae": WAN22_VAE}, SUPER_VARIANT: {"vae": WAN22_VAE}},
    defaults=cosmos3_defaults,
)
