"""MiniMax-H3's DiT in the offload comparison (``offload_families.py --model minimax-h3``):
its forward's inputs as the step pipeline makes them, and the issue's MiniMax-H3 target.

A step of one request is one forward over its packed sequence (``engine.families.
minimax_h3.packing``): ~128 prompt rows, the stereo audio rows, then the video's latent
patches - at the default 1344x768 and 124 frames (5 s at 24 fps), 37 x 24 x 42 = 37296
video rows and 2 x 207 audio rows. The layout is diffusers' own (its layout step's static
builder); the latent rows are random float32 at the middle of both schedules, the prompt
rows random bf16 (the text encoder's output).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from offload_methods import find, target

from ditserve.engine.families.minimax_h3.packing import (
    ItemLayout,
    StepItem,
    install,
    items_in_flight,
    joint_inputs,
)

PROMPT_TOKENS = 128  # a detailed prompt, as tokenized (about)
TEXT_DIM = 5120  # the Qwen3-VL conditioner's width (the DiT's text_dim)


def prepare(dit: Any) -> None:
    """The engine's attention over packed sequences (one forward per step), as served."""
    install(dit)


def _layout(dit: Any, dims: Sequence[int]) -> tuple[ItemLayout, int, int]:
    from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as facts
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
    )

    width, height, frames = dims
    frames = facts.align_num_frames(frames, 17, 5)
    latent_frames = facts.video_latent_num_frames(frames, 17, 5)
    audio = facts.audio_latent_num_frames(frames)
    patch = tuple(int(p) for p in dit.config.patch_size)
    tags = torch.full((PROMPT_TOKENS,), facts.MINIMAX_H3_TEXT_TAG, dtype=torch.long)
    parts = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, latent_frames, height // 16, width // 16, audio, patch,
        facts.MINIMAX_H3_AUDIO_CHANNELS, facts.MINIMAX_H3_AUDIO_TAG,
        facts.MINIMAX_H3_VIDEO_TAG, ())
    layout = ItemLayout(*parts[:5])
    return layout, int(layout.video_indices.shape[0]), int(layout.audio_indices.shape[0])


def step(dit: Any, dims: Sequence[int], *, requests: int, device: torch.device
         ) -> Callable[[], Any]:
    """One denoise forward of ``requests`` requests at WIDTHxHEIGHTxFRAMES."""
    layout, video_rows, audio_rows = _layout(dit, dims)
    config = dit.config
    patch_dim = int(config.in_channels) * int(torch.tensor(config.patch_size).prod())
    items = [StepItem(layout,
                      torch.randn(1, PROMPT_TOKENS, int(config.text_dim), device=device,
                                  dtype=torch.bfloat16),
                      torch.randn(video_rows, patch_dim, device=device),
                      torch.randn(audio_rows, int(config.audio_in_channels), device=device),
                      0.5, 0.5) for _ in range(requests)]
    kwargs = joint_inputs(items, keyframe_noise_aug=0.999, device=device)

    def forward() -> Any:
        with items_in_flight(items):
            return dit(**kwargs, return_dict=False)

    return forward


def targets(r: dict[str, Any], dlo: dict[str, Any], gbps: float | None) -> list[dict[str, Any]]:
    """The issue's target: DLO b1 <= 1.02 x max(resident step, streamed-bytes floor)."""
    out = []
    d1, r1 = find(r, "dlo", "b1"), find(r, "resident", "b1")
    if d1 and r1 and gbps:
        floor = dlo["streamed_bytes"] / (gbps * 1e9) * 1e3
        out.append(target("DLO b1 <= 1.02 x max(resident, streamed-bytes floor)", d1["ms"],
                          1.02 * max(r1["ms"], floor), "ms"))
    return out
