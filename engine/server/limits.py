"""What a request may ask of this replica: the server's flags within the loaded model's own
limits, one frozen record per kind of request.

``ServerState.limits`` and ``ServerState.video_limits`` make them; the parsers enforce them
(``generation.request`` for the image routes, ``videos.request`` for the video jobs) and the
OpenAPI schemas describe the same rules from the same records (``generation.openapi``,
``edits.openapi``, ``videos.openapi``), so a body valid by the document is accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ditserve.engine.config.step_cache import POLICIES as STEP_CACHE_POLICIES
from ditserve.engine.reference_media import ReferenceLimits
from ditserve.engine.request import MAX_SIDE, MAX_STEPS
from ditserve.engine.server.model_defaults import ModelDefaults


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of this replica (from the server config and the loaded model)."""

    model_name: str
    default_size: tuple[int, int]  # (width, height)
    default_steps: int
    pixel_multiple: int
    max_prompt_chars: int | None
    max_side: int = MAX_SIDE
    max_steps: int = MAX_STEPS
    default_guidance: float = ModelDefaults.guidance  # the model's (server.model_defaults)
    default_true_cfg: float = ModelDefaults.true_cfg  # the model's (server.model_defaults)
    max_text_tokens: int = 512  # the most max_sequence_length may be (the loaded pipeline's)
    step_cache_policies: tuple[str, ...] = STEP_CACHE_POLICIES  # what the model takes


@dataclass(frozen=True)
class VideoLimits:
    """What a video request may ask of this replica (server config + the loaded model)."""

    model_name: str
    default_size: tuple[int, int]  # (width, height)
    default_steps: int
    default_frames: int
    default_fps: int
    default_guidance: float
    pixel_multiple: int
    frame_step: int
    max_prompt_chars: int | None
    max_side: int
    max_steps: int
    max_frames: int
    max_text_tokens: int = 512  # the most max_sequence_length may be (the loaded pipeline's)
    step_cache_policies: tuple[str, ...] = STEP_CACHE_POLICIES  # what the model takes
    audio: bool = False  # the model generates a sound track (a request's ``audio``)
    references: ReferenceLimits | None = None  # an omni-reference replica's (``references``)
    min_frames: int = 1  # the shortest clip the model generates (MiniMax-H3: 5 s)

    @property
    def allowed_frames(self) -> list[int]:
        return [f for f in range(1, self.max_frames + 1, self.frame_step)
                if f >= self.min_frames]

    @property
    def min_seconds(self) -> float:
        """The shortest ``seconds`` whose frame count reaches ``min_frames``."""
        return (self.min_frames - 1) / self.default_fps if self.min_frames > 1 else 0.0

    @property
    def max_seconds(self) -> float:
        """The longest ``seconds`` whose frame count stays within ``max_frames``."""
        return self.max_frames / self.default_fps

    @property
    def second_strings(self) -> list[str]:
        """OpenAI's string form: whole seconds, the shortest allowed (1 s or more) up to the
        longest allowed."""
        return [str(s) for s in range(1, math.floor(self.max_seconds) + 1)
                if self.frames_for(s) >= self.min_frames]

    def frames_for(self, seconds: float) -> int:
        """The smallest valid frame count lasting at least ``seconds`` at the native rate."""
        k = self.frame_step
        wanted = seconds * self.default_fps
        # 1e-9: 0.5625 s x 16 fps must be 9 frames, not the float product 9.000000000000002.
        frames = k * max(0, math.ceil((wanted - 1) / k - 1e-9)) + 1
        return min(frames, self.max_frames)
