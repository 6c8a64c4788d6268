"""The MiniMax-H3 family (joint video + audio generation: text-to-video with its sound track,
from a first and/or last frame too): its record and the shapes its builders make.

With the rest of its folder, the only place outside the tests that spells MiniMax-H3's
diffusers class names; the torch-side parts are named lazily: the step pipeline
(``engine.families.minimax_h3.pipeline``, with ``presentation`` and ``keyframes``), the
sequence-parallel hooks
(``engine.families.minimax_h3.sp``) and the random-weight builders
(``engine.families.minimax_h3.builders``).

diffusers ships MiniMax-H3 as a *modular* pipeline only (``MiniMaxH3ModularPipeline`` over
``MiniMaxH3Blocks``; its directory holds ``modular_model_index.json``). Its DiT runs one
stack of 50 full-attention blocks (33.1B parameters at the released shape, 66 GB in bf16)
over ONE packed sequence per request - the prompt's Qwen3-VL hidden states (refined by two
blocks of its own), the stereo audio latents and the video latents - with no
cross-attention; the checkpoint is guidance-distilled (no CFG, one forward per step). Two
rectified-flow schedules step the video (shift 12) and audio (shift 3) rows of the one
forward. Served here: text-to-video with audio (``t2va``) and the keyframe workflow
(``fl2va``: a first and/or last frame, read through the ``processor`` folder's Qwen3-VL
image processor, which the step pipeline loads itself); and, on a ref2va replica (its DiT
the checkpoint's ``transformer_ref``: ``references.write_ref2va_replica``), the
omni-reference workflow (``ref2va``) with image, video and audio references (video ones
read through ``video_processor``, Qwen3-VL's video processor without torchvision).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ditserve.engine.families.base import ComponentShape, Family
from ditserve.engine.families.defaults import ModelDefaults

# diffusers' class defaults are the released DiT (56 heads of 128, 5376 wide, 50 blocks).
FULL: dict[str, Any] = {}
SMALL_LAYERS = 2
TINY_LATENT_CHANNELS = 4  # the tiny VAEs' latent channels (video and audio)
# A few MB: 2 blocks 32 wide, 2 heads (SP2 splits them), 1 refiner block.
TINY: dict[str, Any] = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=32,
                            num_layers=2, num_refiner_layers=1, ffn_dim=64,
                            in_channels=TINY_LATENT_CHANNELS,
                            audio_in_channels=TINY_LATENT_CHANNELS, text_dim=16, freq_dim=16,
                            time_embed_hidden_dim=32, time_embed_dim=16, rope_freq_dim=2)

# The released parts around the DiT. The conditioner is a Qwen3-VL whose hidden state after
# layer 50 is 5120 wide (the DiT's text_dim): the layout of Qwen3-VL-32B (64 layers, 5120
# wide, 64 query / 8 key-value heads of 128, MLP 25600; its vision tower), the nearest
# documented shape. The VAEs' diffusers defaults are the released ones (24 video latent
# channels, 16x spatial, 17 frames -> 5 latent frames; 32 audio channels at 32 kHz).
QWEN3_VL_32B = ComponentShape(
    "transformers", "Qwen3VLForConditionalGeneration", config_class="Qwen3VLConfig",
    config=dict(
        text_config=dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                         num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                         head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                          "mrope_section": [24, 20, 20],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                           out_hidden_size=5120, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, num_position_embeddings=2304,
                           deepstack_visual_indexes=[8, 16, 24])))
RELEASED_COMPONENTS = {
    "text_encoder": QWEN3_VL_32B,
    "vae": ComponentShape("diffusers", "AutoencoderKLMiniMaxH3", config={}),
    "audio_vae": ComponentShape("diffusers", "AutoencoderKLMiniMaxH3Audio", config={}),
}

FPS = 24  # MiniMax-H3 generates at a fixed 24 fps
TEXT_LAYER = 50  # the Qwen3-VL hidden state it conditions on (diffusers' text_encoder_layer)
VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0  # the two released schedules
# The released canvas (diffusers' canvas_short_edge / canvas_max_pixels at 16:9) and the
# shortest clip it generates: 5 s at 24 fps, rounded up to 17 n + 5 frames.
DEFAULT_WIDTH, DEFAULT_HEIGHT, DEFAULT_FRAMES = 1344, 768, 124
# diffusers' default num_inference_steps (50) counts the sigma grid's points, the terminal
# zero included: 49 DiT forwards, which is what a request's num_inference_steps counts here.
DEFAULT_STEPS = 49


def minimax_h3_defaults(dit: Mapping[str, Any], vae: Mapping[str, Any],
                        call: Mapping[str, Any]) -> ModelDefaults:
    """The modular pipeline's own defaults: its 16:9 canvas (1344x768), 124 frames at 24 fps,
    49 forwards; guidance is distilled into the weights (1.0: no CFG)."""
    return ModelDefaults(DEFAULT_WIDTH, DEFAULT_HEIGHT, DEFAULT_STEPS, output="video",
                         frames=DEFAULT_FRAMES, fps=FPS, guidance=1.0)


MINIMAX_H3 = Family(
    name="minimax-h3", label="MiniMaxH3", pipeline_class="MiniMaxH3ModularPipeline",
    dit_class="MiniMaxH3Transformer3DModel", dit_components=("transformer",),
    components=("text_encoder", "tokenizer", "vae", "audio_vae", "scheduler",
                "audio_scheduler"),
    # The refiner's blocks run first (on the prompt's rows), then the 50 blocks.
    block_lists=("token_refiner.refiner_blocks", "transformer_blocks"),
    resident_modules=("proj_in", "audio_proj_in", "context_embedder", "time_proj",
                      "time_embedder", "rope", "token_refiner.final_norm", "norm_out",
                      "proj_out", "audio_proj_out"),
    output="video",
    loader_version="minimax-h3-loader-1",
    # Guidance-distilled: never negative-prompt rows (the pipeline sets one row per video).
    cfg_rows="guidance",
    attention_heads=(56,),  # SP sizes that divide 56: 2, 4, 7, 8, 14, ...
    # 124 frames at 1344x768, one forward per step, in the work rule's units: its frame step
    # is 1 (any frame count, rounded up to 17 n + 5 by the pipeline), so it counts pixel
    # frames of 24 x 42 32-px tokens (the DiT sees 37 latent frames: ~3.4x fewer).
    reference_work=124 * 24 * 42,
    activation_copies=20,
    step_pipeline="ditserve.engine.families.minimax_h3.pipeline:MiniMaxH3StepPipeline",
    sp_hooks="ditserve.engine.families.minimax_h3.sp:attach",
    builders="ditserve.engine.families.minimax_h3.builders",
    dit_sizes={"minimax-h3": {"full": FULL, "small": dict(num_layers=SMALL_LAYERS),
                              "tiny": TINY}},
    released_components={"minimax-h3": RELEASED_COMPONENTS},
    defaults=minimax_h3_defaults,
    min_frames=DEFAULT_FRAMES,
)
