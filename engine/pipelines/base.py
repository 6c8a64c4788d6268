"""The StepPipeline protocol, the factory that picks an implementation, and the preview
decode every pipeline gets from its ``post_decode``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import torch

from ditserve.engine.errors import ModelLoadError

if TYPE_CHECKING:
    from ditserve.engine.denoise_state import DenoiseState
    from ditserve.engine.input_batch import InputBatch
    from ditserve.engine.loader import LoadedComponents


class StepPipeline(Protocol):
    """A diffusion pipeline cut at step boundaries.

    prepare_encode(state): encode the prompt(s), draw the initial latents from the request's
        seed, compute the request's own schedule; fills ``state``.
    denoise_step(batch): one batched transformer forward over every row; returns the model
        output, (rows, tokens, channels).
    step(state, output_rows): combine this request's rows (true CFG) and apply one sampler
        step to its latents; advances ``state.step_index``.
    post_decode(state): decode the final latents into ``state.pixels``, (n, 3, H, W) float
        in [0, 1] on the CPU; on CUDA it may queue the copy without waiting for it (the
        runner hands the pixels back once the step's work has finished).
    """

    transformer: torch.nn.Module
    pixel_multiple: int
    max_prompt_chars: int | None

    def prepare_encode(self, state: DenoiseState) -> None: ...
    def denoise_step(self, batch: InputBatch) -> torch.Tensor: ...
    def step(self, state: DenoiseState, output_rows: torch.Tensor) -> None: ...
    def post_decode(self, state: DenoiseState) -> None: ...


def build_pipeline(
    components: LoadedComponents, *, device: torch.device, move_transformer: bool = True
) -> StepPipeline:
    """The StepPipeline for a loaded model; ``move_transformer`` False leaves the DiT on CPU
    (the offload backend places it)."""
    if components.pipeline_class == "FluxPipeline":
        from ditserve.engine.pipelines.flux import FluxStepPipeline

        return FluxStepPipeline(components, device=device, move_transformer=move_transformer)
    raise ModelLoadError(f"no step-wise pipeline for {components.pipeline_class!r}")


def decode_preview(pipeline: StepPipeline, state: DenoiseState) -> torch.Tensor:
    """A running request's current latents decoded to pixels, (n, 3, H, W) in [0, 1] on the
    CPU (partial images), leaving ``state`` as it was: ``post_decode`` runs on a shallow copy,
    so any pipeline's own decode serves. On CUDA the pixels may still be in flight: the caller
    waits for the stream before reading them."""
    preview = dataclasses.replace(state, pixels=None)
    pipeline.post_decode(preview)
    assert preview.pixels is not None, "post_decode must set state.pixels"
    return preview.pixels
