"""Per-request tensor state of a request being generated (owned by the model runner).

The scheduler only knows ids and counters; everything with tensors lives here: the encoded
prompt rows, the latents, the request's own schedule and step index (never a shared sampler
object), and the decoded output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ditserve.engine.request import SamplingParams
from ditserve.engine.sampler import Schedule


@dataclass
class DenoiseState:
    """One request's trajectory.

    static_rows: tensors fed to every denoise forward, one row per model row (images, then the
        negative-prompt rows under true CFG), e.g. prompt embeddings; built once at encode.
    shared: tensors common to every row of a batch with this request's BatchKey (e.g. the
        position ids of the token grid); the batch takes them from its first request.
    latents: (num_images, tokens, channels) packed latents; the uncond rows reuse them.
    """

    request_id: str
    params: SamplingParams
    seed: int
    schedule: Schedule | None = None
    step_index: int = 0
    latents: torch.Tensor | None = None
    static_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    pixels: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.params.rows

    def current_timestep(self) -> float:
        """The timestep of the next denoise step, as a host float: written into a device
        batch it becomes a fill kernel, where a CPU tensor would be a host-to-device copy that
        waits for everything already queued."""
        assert self.schedule is not None, "state used before prepare_encode"
        return float(self.schedule.timesteps[self.step_index])
