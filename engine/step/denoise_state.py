"""Per-request tensor state of a request being generated (owned by the model runner).

The scheduler only knows ids and counters; everything with tensors lives here: the encoded
prompt rows, the latents, the request's own schedule and step index (never a shared sampler
object), and the decoded output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ditserve.engine.request import SamplingParams
from ditserve.engine.step.sampler import Schedule


@dataclass
class DenoiseState:
    """One request's trajectory.

    static_rows: tensors fed to every denoise forward, one row per model row (images, then the
        negative-prompt rows under true CFG), e.g. prompt embeddings; built once at encode.
    shared: tensors common to every row of a batch with this request's BatchKey (e.g. the
        position ids of the token grid); the batch takes them from its first request.
    latents: (num_images, ...) the pipeline's latents (Flux/Qwen-Image: packed tokens,
        (n, tokens, channels); Wan: (n, C, frames, h, w)); the uncond rows reuse them.
    rows: model rows this request adds to a denoise forward; the pipeline sets it at encode
        (its family decides when CFG adds negative-prompt rows).
    schedule: the request's own timesteps (and sampler state, for multistep samplers).
    pixels: the decoded output, (n, 3, H, W) for images or (n, F, 3, H, W) for videos.
    audio: the decoded sound track of a request that asked for one (``params.audio``),
        (n, channels, samples) float in [-1, 1] on the CPU, at ``audio_rate`` samples/s.
    step_cache: the request's own step cache (``engine.step_cache``: its policy's memory and
        cached residuals, per DiT, one row per model row); None without one. The runner drops
        it after the request's last step.
    """

    request_id: str
    params: SamplingParams
    seed: int
    schedule: Schedule | Any = None
    step_index: int = 0
    latents: torch.Tensor | None = None
    static_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    pixels: torch.Tensor | None = None
    audio: torch.Tensor | None = None
    audio_rate: int = 0
    rows: int = 0
    host: dict[str, Any] = field(default_factory=dict)  # pipeline-private host-side facts
    # Typed loosely: the step data sits below the step cache, which owns this state's type.
    step_cache: Any = None

    def __post_init__(self) -> None:
        if not self.rows:
            self.rows = self.params.rows

    def current_timestep(self) -> float:
        """The timestep of the next denoise step, as a host float: written into a device
        batch it becomes a fill kernel, where a CPU tensor would be a host-to-device copy that
        waits for everything already queued."""
        assert self.schedule is not None, "state used before prepare_encode"
        return float(self.schedule.timesteps[self.step_index])
