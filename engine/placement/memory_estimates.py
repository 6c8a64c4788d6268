"""What each part of a loaded pipeline takes in HBM: the planner's inputs, read off the modules.

Weights are counted exactly (the DiT's blocks as the offload lays them out, so the plan and
the offload agree to the byte). Activations are estimates from the modules' configs, in
multiples of the tensors they hold, calibrated on the H200 measurements in
docs/benchmarks.md (they err on the large side):

- denoise: ``Family.activation_copies`` hidden states of the step's tokens at once (a Flux
  step at b1 1024x1024 measured 0.49 GiB, 18.6 hidden states of its 4608 tokens: 20; a Wan
  block with the engine's sliced math measured 8.5: 10);
- encode: per prompt the hidden state, the feed-forward's gated pair and the attention scores
  (compute dtype, float32 softmax, its cast), plus every layer's hidden state only where the
  pipeline reads them all (Qwen-Image: ``encoder_keeps_hidden_states``; T5 frees each layer's
  input as the next runs - counting them all made Flux's encode phase 3.4 GiB, the largest
  term of its 6.77 GiB prediction against 3.06 measured);
- VAE decode: ``*_DECODE_COPIES`` tensors of the full-resolution stage's width over one
  chunk of output (a frame; Wan: the 4 frames one latent frame decodes to; its 832x480
  decode measured 4.27 GiB against 4.57 estimated), plus the output and its float32 copies;
  tiled, one tile's worth per row (sliced) plus the stored tiles and the output.

Called by ``engine.runner.assembly`` (``budget_inputs``) and, per decode, by
``engine.placement.decode_batches``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ditserve.engine.config import PipelineConfig, ResolvedOffload, SchedulerConfig
from ditserve.engine.config.resolved_offload import ENCODER_SLOTS
from ditserve.engine.errors import ConfigError, OffloadError
from ditserve.engine.families.base import dit_width
from ditserve.engine.offload.builders import block_tensors, slot_count
from ditserve.engine.offload.discovery import discover
from ditserve.engine.offload.plan import TensorSpec, layout_block
from ditserve.engine.offload.slot_dequant import slot_decoded_bytes
from ditserve.engine.pipelines.capabilities import (
    encoder_reads_images,
    host_modules_of,
    keeps_encoder_hidden_states,
    most_condition_tokens_of,
)
from ditserve.engine.pipelines.vae_decode import DEFAULT_TILE_PIXELS
from ditserve.engine.placement.budget_plan import BudgetInputs
from ditserve.engine.placement.component_placement import module_bytes
from ditserve.engine.placement.encoder_streaming import host_side_bytes
from ditserve.engine.placement.prompt_cache import ENCODER_ATTRS
from ditserve.engine.sched.work import ResolvedScheduling

IMAGE_DECODE_COPIES = 6  # AutoencoderKL's 2-D decoder
VIDEO_DECODE_COPIES = 8  # Wan's causal 3-D decoder (and Qwen-Image's, built the same way)
# The shape a video model's decode is planned for when nothing bounds it: Wan's own default.
VIDEO_PLAN_SHAPE = (81, 480, 832)
TEMPLATE_TOKENS = 64  # prompt templates (Qwen-Image's) on top of the text tokens
CFG_ROWS = 2  # a request with classifier-free guidance: its positive and negative rows


def dit_blocks(transformer: torch.nn.Module, block_lists: Any) -> tuple[int, tuple[int, ...]]:
    """(bytes outside the blocks, each block's laid-out bytes in call order) of a DiT, or of
    any module DLO streams (``block_lists`` None: the lists discovery finds)."""
    found = discover(transformer, block_lists)
    sizes = []
    inside: set[int] = set()
    for i, (name, module) in enumerate(found.blocks):
        named = block_tensors(module)
        inside.update(id(t) for _, t in named)
        specs = [TensorSpec(n, t.dtype, t.element_size(), tuple(t.shape)) for n, t in named]
        sizes.append(layout_block(i, name, specs).nbytes)
    fixed = sum(t.numel() * t.element_size()
                for t in (*transformer.parameters(), *transformer.buffers()) if id(t) not in inside)
    return fixed, tuple(sizes)


def dit_decoded_bytes(transformer: torch.nn.Module, block_lists: Any) -> int:
    """The decoded region one slot holds under ``--dlo-dequant slot``: the largest block's
    GGUF weights in their compute dtype (0 without GGUF layers)."""
    return slot_decoded_bytes(module for _, module in discover(transformer, block_lists).blocks)


def streamed_encoder_bytes(encoder: torch.nn.Module, *, vision: bool = False) -> int | None:
    """What a streamed encoder holds on the device (its modules outside its layer lists but
    not kept on the host - with ``vision``, as for a text-only pipeline, its vision side
    neither - and ``ENCODER_SLOTS`` slots of its largest layer); None if DLO finds no layers
    to stream."""
    try:
        fixed, layers = dit_blocks(encoder, None)
    except OffloadError:
        return None
    return (fixed - host_side_bytes(encoder, vision=vision)
            + ENCODER_SLOTS * max(layers, default=0))


def streamed_encoder_slot_bytes(encoder: torch.nn.Module) -> int | None:
    """Of ``streamed_encoder_bytes``: the ``ENCODER_SLOTS`` slots of its largest layer, which
    a streamed encoder gives back between its passes (``encoder_streaming``); None if DLO
    finds no layers to stream."""
    try:
        _, layers = dit_blocks(encoder, None)
    except OffloadError:
        return None
    return ENCODER_SLOTS * max(layers, default=0)


def _config_value(config: Any, *names: str) -> int:
    for source in (config, getattr(config, "text_config", None)):
        for name in names:
            value = getattr(source, name, None)
            if isinstance(value, int):
                return value
    return 0


def encode_activation_bytes(encoder: torch.nn.Module, *, prompts: int, tokens: int,
                            all_layers: bool = False) -> int:
    """One pass of ``encoder`` over ``prompts`` prompts of ``tokens`` tokens each;
    ``all_layers``: the pipeline reads every layer's hidden state (Qwen-Image), so they are
    all alive at the end (otherwise each layer's input is freed as the next one runs)."""
    cfg = getattr(encoder, "config", None)
    width = _config_value(cfg, "d_model", "hidden_size") or 1024
    ffn = _config_value(cfg, "d_ff", "intermediate_size") or 4 * width
    heads = _config_value(cfg, "num_heads", "num_attention_heads") or 16
    layers = _config_value(cfg, "num_layers", "num_hidden_layers") or 24
    elem = next(encoder.parameters()).element_size()
    kept = (layers + 1) * width if all_layers else 0
    per_prompt = tokens * elem * (8 * width + 4 * ffn + kept)
    # The scores in the compute dtype, their float32 softmax and its cast back (T5's eager
    # attention; an SDPA encoder holds less).
    scores = heads * tokens * tokens * (2 * elem + 4)
    return prompts * (per_prompt + scores)


def _full_res_channels(vae: Any) -> int:
    cfg = vae.config
    if "block_out_channels" in cfg:  # AutoencoderKL: the tensor upsampled into full res
        widths = list(cfg.block_out_channels)
        return int(widths[1] if len(widths) > 1 else widths[0])
    base = int(cfg.get("decoder_base_dim") or cfg.get("base_dim", 96))
    mult = list(cfg.get("dim_mult", [1, 2]))
    return base * int(mult[1] if len(mult) > 1 else mult[0])


def decode_bytes(vae: Any, *, rows: int, frames: int, height: int, width: int,
                 tiled: bool, tile_pixels: int = DEFAULT_TILE_PIXELS) -> int:
    """Activation peak of one decode call of ``rows`` rows of (frames, height, width)."""
    elem = next(vae.parameters()).element_size()
    video = "block_out_channels" not in vae.config
    chunk = int(vae.config.get("scale_factor_temporal") or 4) if video and frames > 1 else 1
    copies = VIDEO_DECODE_COPIES if video else IMAGE_DECODE_COPIES
    pixels = height * width
    # decoded rows (elem), the cat of a video's frames (x2), float32 post-processing (x3)
    output = rows * 3 * frames * pixels * (2 * elem + 3 * 4)
    if tiled:
        tile = min(pixels, tile_pixels * tile_pixels)
        stored = math.ceil(rows * 3 * frames * pixels * elem * (4 / 3) ** 2)
        return copies * _full_res_channels(vae) * tile * chunk * elem + stored + output
    return rows * copies * _full_res_channels(vae) * pixels * chunk * elem + output


def planned_shape(pipeline: Any) -> tuple[int, int, int]:
    """(frames, height, width) the decode is planned for: one request of the family's usual
    size (``Family.reference_work``: a 1024x1024 image; Wan's 832x480 x 81 frames)."""
    if pipeline.frame_step is not None:
        return VIDEO_PLAN_SHAPE
    side = math.isqrt(int(pipeline.family.reference_work)) * int(pipeline.pixel_multiple)
    return 1, side, side


def planned_step_tokens(pipeline: Any, sched: ResolvedScheduling) -> int:
    """The latent tokens of the largest step the scheduler may run: its work budget
    (``max_batch_tokens``, conditioning tokens included - the work rule counts them), or one
    request above it, which runs alone up to ``max_request_tokens``: the family's usual
    request with the most conditioning the pipeline admits (``most_condition_tokens``: an
    edit's largest sources, FLUX.2's ten references, MiniMax-H3's nine image references) on
    both rows of a CFG pair. Without conditioning that is the budget itself."""
    most = most_condition_tokens_of(pipeline)
    lone = int(pipeline.family.reference_work) + CFG_ROWS * most
    return max(sched.max_batch_tokens, min(sched.max_request_tokens, lone)) if most \
        else sched.max_batch_tokens


def _dit_width(transformer: torch.nn.Module) -> int:
    """The DiT's hidden width (an expert stack's: its first expert's)."""
    configs = (getattr(m, "config", None) for m in transformer.modules())
    cfg: dict[str, Any] = next((c for c in configs if isinstance(c, dict)), {})
    return dit_width(cfg) or 24 * 128


def auto_budget(device: torch.device, *,
                mem_get_info: Callable[[torch.device], tuple[int, int]] | None = None,
                memory_reserved: Callable[[torch.device], int] | None = None) -> int:
    """``--dlo-hbm-budget-gib auto``: the device's free HBM plus what this process's allocator
    already holds (the components placed so far are in the plan; its cached blocks are free
    to reuse). The two readers default to torch.cuda's (tests pass fakes)."""
    if device.type != "cuda":
        raise ConfigError(
            f"--dlo-hbm-budget-gib auto reads the free HBM of a CUDA device; {device} has none: "
            "give a number of GiB, or run on a GPU")
    free, _ = (mem_get_info or torch.cuda.mem_get_info)(device)
    return int(free) + int((memory_reserved or torch.cuda.memory_reserved)(device))


def budget_inputs(pipeline: Any, *, scheduler: SchedulerConfig, pipeline_config: PipelineConfig,
                  offload: ResolvedOffload, group_size: int = 1) -> BudgetInputs:
    """Everything ``plan_budget`` needs, measured off ``pipeline`` under the scheduling
    (requests per step), the pipeline's settings (prompt cache, VAE tiling) and the offload
    (slots, whether DLO governs the encoders)."""
    transformer = pipeline.transformer
    fixed, blocks = dit_blocks(transformer, pipeline.block_lists)
    # Modules the pipeline keeps in host memory (Cosmos3's token table) never reach the HBM.
    fixed -= sum(module_bytes(m) for m in host_modules_of(pipeline))
    sched = ResolvedScheduling.for_family(scheduler, pipeline.family)
    text = int(getattr(pipeline, "max_text_tokens", None) or pipeline.max_sequence_length)
    rows = 2 * sched.max_num_seqs  # with CFG every request brings a negative prompt's row
    # The pipeline's compute dtype (Wan's skips the float32 tables diffusers keeps first,
    # whose 4 bytes once doubled this estimate).
    elem = pipeline.dtype.itemsize
    denoise = (pipeline.family.activation_copies * (planned_step_tokens(pipeline, sched)
                                                    + rows * text)
               * _dit_width(transformer) * elem)
    encoders = tuple((name, m) for name in ENCODER_ATTRS
                     if isinstance(m := getattr(pipeline, name, None), torch.nn.Module))
    text_only = not encoder_reads_images(pipeline)
    streamable = tuple((name, held) for name, m in encoders
                       if (held := streamed_encoder_bytes(m, vision=text_only)) is not None)
    released = tuple((name, slots) for name, m in encoders
                     if (slots := streamed_encoder_slot_bytes(m)) is not None)
    all_layers = keeps_encoder_hidden_states(pipeline)
    encode = max((encode_activation_bytes(m, prompts=rows, tokens=text + TEMPLATE_TOKENS,
                                          all_layers=all_layers)
                  for _, m in encoders), default=0)
    vae = pipeline.vae
    frames, height, width = planned_shape(pipeline)
    shape = {"rows": 1, "frames": frames, "height": height, "width": width}
    can_tile = hasattr(vae, "enable_tiling")
    return BudgetInputs(
        dit_fixed=fixed, dit_blocks=blocks,
        slots=slot_count(offload.options, len(blocks), group_size),
        encoders=tuple((name, module_bytes(m)) for name, m in encoders),
        parkable=offload.components == "all", encode_activations=encode,
        vae=module_bytes(vae), decode_whole=decode_bytes(vae, tiled=False, **shape),
        decode_tiled=decode_bytes(vae, tiled=True, **shape) if can_tile else None,
        denoise_activations=denoise,
        prompt_cache=int(pipeline_config.prompt_cache_gib * (1 << 30))
        if pipeline_config.prompt_cache_size > 0 else 0,
        vae_tiling=pipeline_config.vae_tiling, streamable=streamable, streamed_slots=released,
        decode_shape=(frames, height, width),
        slot_extra=dit_decoded_bytes(transformer, pipeline.block_lists)
        if offload.options.dequant == "slot" else 0)
