"""The one CFG combine-and-step (``engine.pipelines.guidance``) every family's ``step`` calls:
each variant's formula, and the step it takes along the request's own schedule. The families'
bit-equality with diffusers is tests/families/test_reference.py's."""

from __future__ import annotations

import torch

from ditserve.engine.pipelines.guidance import guided, guided_step
from ditserve.engine.request import SamplingParams
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step.sampler import FlowMatchEulerSampler, Schedule

ROWS = torch.tensor([[[1.0, 2.0]], [[3.0, -1.0]]])  # (2 rows, 1 token, 2 channels): cond, uncond
COND, UNCOND = ROWS[:1], ROWS[1:]


def test_without_a_scale_the_rows_are_the_prediction() -> None:
    assert torch.equal(guided(ROWS[:1], 1, None), ROWS[:1])


def test_guidance_interpolates_from_the_unconditional_rows() -> None:
    assert torch.equal(guided(ROWS, 1, 4.0), UNCOND + 4.0 * (COND - UNCOND))


def test_renorm_keeps_the_conditional_norm_per_token() -> None:
    out = guided(ROWS, 1, 4.0, renorm=True)
    assert torch.allclose(torch.norm(out, dim=-1), torch.norm(COND, dim=-1))
    direction = UNCOND + 4.0 * (COND - UNCOND)
    assert torch.allclose(out / torch.norm(out, dim=-1, keepdim=True),
                          direction / torch.norm(direction, dim=-1, keepdim=True))


def test_from_conditional_extrapolates_from_the_conditional_rows() -> None:
    assert torch.equal(guided(ROWS, 1, 4.0, from_conditional=True), COND + 4.0 * (COND - UNCOND))


def test_the_step_moves_the_latents_along_the_schedule_and_advances() -> None:
    schedule = Schedule(timesteps=torch.tensor([1000.0, 500.0]),
                        sigmas=torch.tensor([1.0, 0.5, 0.0]))
    state = DenoiseState("r", SamplingParams(prompt="p"), 0)
    state.schedule, state.latents = schedule, torch.zeros(1, 1, 2)
    guided_step(state, ROWS, 4.0)
    expected = FlowMatchEulerSampler.step(torch.zeros(1, 1, 2), UNCOND + 4.0 * (COND - UNCOND),
                                          schedule, 0)
    assert state.step_index == 1
    assert torch.equal(state.latents, expected)
