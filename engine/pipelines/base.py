"""The StepPipeline protocol (what the model runner needs from every family's pipeline) and
the preview decode every pipeline gets from its ``post_decode``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import torch

from ditserve.engine.families import Family
from ditserve.engine.request import ModelLimits

if TYPE_CHECKING:
    from ditserve.engine.step.denoise_state import DenoiseState
    from ditserve.engine.step.input_batch import InputBatch


class StepPipeline(Protocol):
    """A diffusion pipeline cut at step boundaries.

    prepare_encode(state): encode the prompt(s), draw the initial latents from the request's
        seed, compute the request's own schedule, and set ``state.rows`` (the family decides
        when classifier-free guidance adds negative-prompt rows); fills ``state``.
    denoise_step(batch): the batch's model output, (rows, ...) in batch order; one
        transformer forward over every row (a model whose experts take turns runs one forward
        per expert over that expert's rows).
    step(state, output_rows): combine this request's rows (CFG) and apply one sampler
        step to its latents; advances ``state.step_index``.
    post_decode(state): decode the final latents into ``state.pixels``: (n, 3, H, W) for an
        image family, (n, F, 3, H, W) for a video family, float in [0, 1] on the CPU; on CUDA
        it may queue the copy without waiting for it (the runner hands the pixels back once
        the step's work has finished).

    family: the family's pure record (``engine.families``: CFG-row rule, batch-key fields).
    transformer: the module offload streams and compilation compiles (the DiT, or an
        ``ExpertStack`` of experts); block_lists: its streamed block lists in call order.
    pixel_multiple: the spatial granularity of height and width; pixels_per_token
        (optional, default pixel_multiple): the pixel side of one DiT token, for the work
        rule (Cosmos3: sizes in 16 px, tokens of 32 px).
    frame_step: None for image families; for video, ``num_frames - 1`` must divide by it.
    max_sequence_length: text tokens per prompt when a request names none (the diffusers
        pipeline's own default); max_text_tokens: the most a request may ask for.
    host_modules (optional): modules of the DiT outside its block lists that stay in host
        memory, neither resident nor streamed under offload (Cosmos3's token table, whose
        rows the pipeline uploads itself, and its unused language-model head).
    min_frames (optional, default 1): the shortest clip the model generates (MiniMax-H3:
        5 s); the engine's warm-up request asks for it.
    limits(): what the model can run (sizes and frames its positional tables reach), read off
        its own config; the engine checks every request against it.

    What a pipeline may declare beyond these (input images, host modules, a token side, ...)
    are the optional capabilities of ``pipelines.capabilities``.
    """

    family: Family
    transformer: torch.nn.Module
    block_lists: tuple[str, ...]
    pixel_multiple: int
    frame_step: int | None
    max_prompt_chars: int | None
    max_sequence_length: int
    max_text_tokens: int

    def prepare_encode(self, state: DenoiseState) -> None: ...
    def denoise_step(self, batch: InputBatch) -> torch.Tensor: ...
    def step(self, state: DenoiseState, output_rows: torch.Tensor) -> None: ...
    def post_decode(self, state: DenoiseState) -> None: ...
    def limits(self) -> ModelLimits: ...


def decode_preview(pipeline: StepPipeline, state: DenoiseState) -> torch.Tensor:
    """A running request's current latents decoded to pixels, (n, 3, H, W) in [0, 1] on the
    CPU (partial images), leaving ``state`` as it was: ``post_decode`` runs on a shallow copy,
    so any pipeline's own decode serves. On CUDA the pixels may still be in flight: the caller
    waits for the stream before reading them."""
    preview = dataclasses.replace(state, pixels=None)
    pipeline.post_decode(preview)
    assert preview.pixels is not None, "post_decode must set state.pixels"
    return preview.pixels
