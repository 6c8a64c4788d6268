"""The Z-Image family (Z-Image-Turbo and Z-Image Base): its record and the shapes its
builders make.

One family for both checkpoints: they share the DiT (a 6.15B single-stream DiT, 30 layers
3840 wide, with two noise- and two context-refiner blocks), the Qwen3-4B text encoder and
Flux's VAE; what differs is how they are run, which the checkpoint decides (``defaults``):
Turbo is distilled to 8 steps without guidance, Base runs the pipeline's own 50 steps with
classifier-free guidance.

With the rest of its folder, the only place outside the tests that spells Z-Image's
diffusers class names; the torch-side parts are named lazily: the step pipeline
(``engine.families.z_image.pipeline``), the sequence-parallel hooks
(``engine.families.z_image.sp``) and the random-weight builders
(``engine.families.z_image.builders``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.families.base import ComponentShape, Family
from ditserve.engine.families.defaults import TINY, ModelDefaults, image_side

# The DiT's keyword arguments per size: "full" is the class defaults, i.e. the released DiT
# (dim 3840, 30 layers + 2 + 2 refiners, 30 heads of 128, Qwen3-4B's 2560-wide captions);
# "small" keeps the widths with one layer of each kind; "tiny" is a few MB.
DIT_SIZES: dict[str, dict[str, Any]] = {
    "full": {},
    "small": dict(n_layers=2, n_refiner_layers=1),
    "tiny": dict(dim=32, n_layers=3, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                 cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[1024, 64, 64]),
}
# The released parts around the DiT (Z-Image-Turbo's text_encoder and vae config.json):
# Qwen3-4B without its LM head (~4.0B parameters, 8.0 GB in bf16) and Flux's 16-channel VAE.
RELEASED_COMPONENTS: dict[str, ComponentShape] = {
    "text_encoder": ComponentShape(
        "transformers", "Qwen3Model", config_class="Qwen3Config",
        config=dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                    tie_word_embeddings=True)),
    "vae": ComponentShape("diffusers", "AutoencoderKL", config=dict(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512],
        layers_per_block=2, latent_channels=16, norm_num_groups=32, sample_size=1024,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
        use_post_quant_conv=False)),
}

# Z-Image-Turbo's released scheduler (shift 3, no resolution-dependent shift) marks the
# distilled checkpoint: 8 DiT steps, no guidance (its model card's call). Base's differs and
# runs the pipeline's own defaults.
TURBO_SCHEDULER = {"shift": 3.0, "use_dynamic_shifting": False}
TURBO_STEPS = 8
TURBO_GUIDANCE = 0.0
TEST_MODEL_WIDTH = 1024  # narrower DiTs are test models (the tiny one is 32 wide)


def is_turbo(scheduler: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's scheduler config is Z-Image-Turbo's (see ``TURBO_SCHEDULER``)."""
    return float(scheduler.get("shift", 1.0)) == TURBO_SCHEDULER["shift"] \
        and not scheduler.get("use_dynamic_shifting", False)


def call_overrides(scheduler: Mapping[str, Any]) -> Mapping[str, Any]:
    """What the checkpoint changes of the pipeline's call defaults: Turbo's 8 steps without
    guidance; nothing for Base (50 steps, guidance 5.0: the pipeline's own)."""
    if is_turbo(scheduler):
        return {"num_inference_steps": TURBO_STEPS, "guidance_scale": TURBO_GUIDANCE}
    return {}


def defaults(dit: Mapping[str, Any], vae: Mapping[str, Any],
             call: Mapping[str, Any]) -> ModelDefaults:
    """A square of the VAE's size (1024) and the step count of ``call`` (the pipeline's,
    after ``call_overrides``); a DiT narrower than 1024 is a test model (64x64, 4 steps)."""
    width = dit.get("dim")
    if isinstance(width, int) and width < TEST_MODEL_WIDTH:
        return TINY
    side = image_side(vae)
    return ModelDefaults(side, side, int(call["num_inference_steps"]))


Z_IMAGE = Family(
    name="z-image", label="ZImage", pipeline_class="ZImagePipeline",
    pipeline_module="diffusers.pipelines.z_image.pipeline_z_image",
    dit_class="ZImageTransformer2DModel", dit_components=("transformer",),
    components=("vae", "text_encoder", "tokenizer", "scheduler"),
    # In the order the forward runs them: image tokens, caption tokens, then both together.
    block_lists=("noise_refiner", "context_refiner", "layers"),
    resident_modules=("all_x_embedder", "all_final_layer", "t_embedder", "cap_embedder"),
    output="image",
    loader_version="z-image-loader-1",
    cfg_rows="guidance_positive",  # diffusers: CFG whenever guidance_scale > 0
    attention_heads=(30,),  # Z-Image-Turbo / Base
    step_pipeline="ditserve.engine.families.z_image.pipeline:ZImageStepPipeline",
    sp_hooks="ditserve.engine.families.z_image.sp:attach",
    builders="ditserve.engine.families.z_image.builders",
    dit_sizes={"z-image": DIT_SIZES},  # Z-Image-Turbo (6.15B)
    released_components={"z-image": RELEASED_COMPONENTS},
    defaults=defaults,
    call_overrides=call_overrides,
)
