"""Classifier-free guidance: combine a request's CFG rows, then take its sampler step.

Every family's ``StepPipeline.step`` does the same two things with a request's rows of the
forward: when its CFG is on, the first ``num_images`` rows (conditional) and the rest
(unconditional) combine into one prediction at the guidance scale - optionally rescaled to the
conditional prediction's norm (Qwen-Image, as diffusers) - and the request's own schedule
steps its latents with it. ``guided_step`` is that, once; the families say only which scale
applies (``true_cfg_scale``, ``guidance_scale``, none) and which variant of the combination
their reference pipeline computes, so each stays bit-equal to it (tests/families/
test_reference.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ditserve.engine.step.denoise_state import DenoiseState


def guided(rows: torch.Tensor, images: int, scale: float | None, *, renorm: bool = False,
           from_conditional: bool = False) -> torch.Tensor:
    """One prediction of ``images`` rows from a request's forward ``rows``.

    scale: the guidance scale, or None when the request runs no CFG (``rows`` are then its
        prediction already).
    renorm: rescale the guided prediction to the conditional one's norm, per token.
    from_conditional: extrapolate from the conditional rows - ``cond + s (cond - uncond)``,
        Z-Image's form - rather than interpolate from the unconditional ones,
        ``uncond + s (cond - uncond)``; the two differ by one in ``s`` and in rounding.
    """
    if scale is None:
        return rows
    cond, uncond = rows[:images], rows[images:]
    if from_conditional:
        return cond + scale * (cond - uncond)
    prediction = uncond + scale * (cond - uncond)
    if renorm:
        cond_norm = torch.norm(cond, dim=-1, keepdim=True)
        prediction = prediction * (cond_norm / torch.norm(prediction, dim=-1, keepdim=True))
    return prediction


def guided_step(state: DenoiseState, rows: torch.Tensor, scale: float | None, *,
                renorm: bool = False, from_conditional: bool = False) -> None:
    """Combine ``state``'s CFG rows (``guided``) and step its latents with its own schedule;
    advances ``state.step_index``."""
    assert state.schedule is not None and state.latents is not None
    prediction = guided(rows, state.params.num_images, scale, renorm=renorm,
                        from_conditional=from_conditional)
    state.latents = state.schedule.step(state.latents, prediction, state.step_index)
    state.step_index += 1
