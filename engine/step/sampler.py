"""Flow-matching Euler sampler with no hidden state.

The step index lives on each request, so one batch can mix requests at different timesteps.
The schedule (timesteps and sigmas) is computed once per request with diffusers'
FlowMatchEulerDiscreteScheduler so it matches diffusers exactly; the per-step update is the
Euler rule, written here because the diffusers object keeps a step counter (one object per
trajectory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Schedule:
    """timesteps: (steps,) model-time values; sigmas: (steps + 1,) ending at 0."""

    timesteps: torch.Tensor
    sigmas: torch.Tensor

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])

    def step(self, sample: torch.Tensor, model_output: torch.Tensor,
             step_index: int) -> torch.Tensor:
        """One Euler step along this schedule (``FlowMatchEulerSampler.step``): the same call
        as a ``SchedulerTrajectory``'s, so a pipeline steps any request's own schedule alike."""
        return FlowMatchEulerSampler.step(sample, model_output, self, step_index)


def _calculate_shift(image_seq_len: int, config: Any) -> float:
    # Resolution-dependent shift of Flux: linear in the token count between two anchors.
    base_len = config.get("base_image_seq_len", 256)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + (base_shift - slope * base_len)


# diffusers' time shift computes exp(mu) in Python floats, which overflow past exp(709.78):
# the largest shift a schedule may take, with room for the rest of the formula.
MAX_SHIFT_MU = 700.0


def max_shift_tokens(config: Any) -> int | None:
    """The most image tokens whose resolution-dependent shift the schedule can compute
    (diffusers raises OverflowError past it); None without dynamic shifting."""
    if not config.get("use_dynamic_shifting", False):
        return None
    zero, one = _calculate_shift(0, config), _calculate_shift(1, config)
    slope = one - zero
    return None if slope <= 0 else int((MAX_SHIFT_MU - zero) / slope)


class FlowMatchEulerSampler:
    """Builds per-request schedules and applies one Euler step to any slice of a batch."""

    def __init__(self, scheduler_config: Any) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler

        self._scheduler_cls = FlowMatchEulerDiscreteScheduler
        self._config = scheduler_config
        self.max_tokens = max_shift_tokens(scheduler_config)

    def schedule(self, num_steps: int, image_seq_len: int, *,
                 mu: float | None = None) -> Schedule:
        """The schedule of ``num_steps`` for ``image_seq_len`` latent tokens. ``mu``: the
        shift of a dynamically shifting scheduler when the pipeline computes its own (FLUX.2's
        empirical fit of tokens and steps); by default Flux's linear rule in the token count."""
        # A throwaway scheduler object: it only computes the schedule, never steps.
        scheduler = self._scheduler_cls.from_config(self._config)
        kwargs: dict[str, Any] = {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps)}
        if self._config.get("use_dynamic_shifting", False):
            kwargs["mu"] = _calculate_shift(image_seq_len, self._config) if mu is None else mu
        with np.errstate(invalid="ignore", divide="ignore"):  # the one-step case below
            scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        timesteps, sigmas = scheduler.timesteps.clone(), scheduler.sigmas.clone()
        if bool(torch.isnan(sigmas).any()):
            # One step stretched to a terminal sigma (Qwen-Image's shift_terminal) divides 0
            # by 0, and diffusers' own schedule is NaN (a black image). Its limit is what the
            # stretch does to every schedule's first sigma: it stays 1.
            sigmas = torch.nan_to_num(sigmas, nan=1.0)
            timesteps = sigmas[:-1] * float(self._config.get("num_train_timesteps", 1000))
        return Schedule(timesteps=timesteps, sigmas=sigmas)

    @staticmethod
    def step(
        sample: torch.Tensor, model_output: torch.Tensor, schedule: Schedule, step_index: int
    ) -> torch.Tensor:
        """x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v, computed in fp32 like diffusers."""
        sigmas = schedule.sigmas
        dt = sigmas[step_index + 1] - sigmas[step_index]
        prev = sample.to(torch.float32) + dt * model_output
        return prev.to(model_output.dtype)


class SchedulerTrajectory:
    """One request's own diffusers scheduler object, for samplers with history.

    Multistep samplers (Wan's UniPC) keep earlier model outputs between steps, so their state
    is per trajectory: each request owns one scheduler object, made from the model's
    scheduler config and never shared, so requests at different steps still share a forward.
    ``step`` asserts the object's own counter agrees with the request's step index.
    """

    def __init__(self, scheduler_cls: Any, config: Any, num_steps: int,
                 sigmas: Any = None) -> None:
        """``sigmas``: a schedule the pipeline passes diffusers' ``set_timesteps`` itself
        (None: the scheduler's own for ``num_steps``)."""
        self._scheduler = scheduler_cls.from_config(config)
        if sigmas is None:
            self._scheduler.set_timesteps(num_steps, device="cpu")
        else:
            self._scheduler.set_timesteps(num_steps, device="cpu", sigmas=sigmas)
        self._scheduler.set_begin_index(0)
        self.timesteps: torch.Tensor = self._scheduler.timesteps.clone()

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])

    def step(
        self, sample: torch.Tensor, model_output: torch.Tensor, step_index: int
    ) -> torch.Tensor:
        index = self._scheduler.step_index
        assert index in (None, step_index), f"trajectory at step {index}, asked for {step_index}"
        return self._scheduler.step(  # type: ignore[no-any-return]
            model_output, self.timesteps[step_index], sample, return_dict=False
        )[0]
