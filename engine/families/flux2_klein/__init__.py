"""The FLUX.2 [klein] family (4B and 9B): its record and the shapes its builders make.

With the rest of its folder, the only place outside the tests that spells [klein]'s
diffusers pipeline class. Its DiT is FLUX.2's class (``engine.families.flux2`` spells it;
this record takes it from there, which declares the derivation): smaller (4B: 5 double + 20
single blocks, 3072 wide; 9B: 8 + 24, 4096 wide), without a guidance embedding. Its text
encoder is Qwen3 (4B: Qwen3-4B, 9B: Qwen3-8B), the prompt the stack of hidden layers 9, 18
and 27; guidance is true classifier-free guidance against the empty prompt whenever
``guidance_scale`` > 1, as diffusers' pipeline (skipped for the step-distilled models, whose
``model_index.json`` sets ``is_distilled``). The torch-side parts are named lazily: the step
pipeline (``engine.families.flux2_klein.pipeline``), the sequence-parallel hooks (FLUX.2's,
the same DiT) and the builders (``engine.families.flux2_klein.builders``).
"""

from __future__ import annotations

from typing import Any

from ditserve.engine.families.base import ComponentShape, Family
from ditserve.engine.families.flux2 import DIT_SIZES as DEV_SIZES
from ditserve.engine.families.flux2 import FLUX2, VAE


def _sizes(full: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A [klein] variant's sizes: ``full`` (its released config), "small" (its widths with
    1 + 2 blocks and 4 heads) and the tiny DiT without a guidance embedding."""
    small = dict(full, num_layers=1, num_single_layers=2, num_attention_heads=4)
    return {"full": full, "small": small,
            "tiny": dict(DEV_SIZES["tiny"], guidance_embeds=False)}


# The released DiT configs (FLUX.2-klein-4B / -9B transformer/config.json): the text input
# is three stacked Qwen3 layers (3 x 2560 / 3 x 4096), no guidance embedding.
DIT_SIZES_4B = _sizes(dict(
    patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256,
    mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=False))
DIT_SIZES_9B = _sizes(dict(
    patch_size=1, in_channels=128, num_layers=8, num_single_layers=24, attention_head_dim=128,
    num_attention_heads=32, joint_attention_dim=12288, timestep_guidance_channels=256,
    mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=False))


def _qwen3(hidden: int, intermediate: int, tied: bool) -> ComponentShape:
    """A released Qwen3 causal LM (its config.json's shape-defining values)."""
    return ComponentShape("transformers", "Qwen3ForCausalLM", config_class="Qwen3Config",
                          config=dict(vocab_size=151936, hidden_size=hidden,
                                      intermediate_size=intermediate, num_hidden_layers=36,
                                      num_attention_heads=32, num_key_value_heads=8,
                                      head_dim=128, max_position_embeddings=40960,
                                      rms_norm_eps=1e-6,
                                      rope_parameters={"rope_type": "default",
                                                       "rope_theta": 1000000.0},
                                      tie_word_embeddings=tied))


RELEASED_COMPONENTS: dict[str, dict[str, ComponentShape]] = {
    "flux2-klein": {"text_encoder": _qwen3(2560, 9728, tied=True), "vae": VAE},  # Qwen3-4B
    "flux2-klein-9b": {"text_encoder": _qwen3(4096, 12288, tied=False), "vae": VAE},  # Qwen3-8B
}

FLUX2_KLEIN = Family(
    name="flux2-klein", label="Flux2Klein", pipeline_class="Flux2KleinPipeline",
    pipeline_module="diffusers.pipelines.flux2.pipeline_flux2_klein",
    dit_class=FLUX2.dit_class, dit_components=FLUX2.dit_components,
    components=FLUX2.components, block_lists=FLUX2.block_lists,
    resident_modules=FLUX2.resident_modules,
    output="image", loader_version="flux2-klein-loader-1",
    cfg_rows="guidance",  # CFG against "" whenever guidance_scale > 1 (non-distilled models)
    attention_heads=(24, 32),  # 4B, 9B
    step_pipeline="ditserve.engine.families.flux2_klein.pipeline:Flux2KleinStepPipeline",
    sp_hooks=FLUX2.sp_hooks,
    builders="ditserve.engine.families.flux2_klein.builders",
    dit_sizes={"flux2-klein": DIT_SIZES_4B, "flux2-klein-9b": DIT_SIZES_9B},
    released_components=RELEASED_COMPONENTS,
)
