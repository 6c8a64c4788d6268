"""Qwen3-VL's video processor without torchvision: what MiniMax-H3's conditioner reads of a
video reference.

transformers' ``Qwen3VLVideoProcessor`` is a torchvision class (its base, ``BaseVideoProcessor``,
resizes and normalizes through ``torchvision.transforms.v2``), and torchvision is not
installable beside the CPU torch ditserve runs on here. What diffusers' ``ref2va`` encoder
asks of it is small: frames already sampled (``do_sample_frames=False``), each video resized
once to the size ``smart_resize`` gives its frame count, rescaled and normalized in one
pass, and cut into Qwen3-VL's patches. ``VideoProcessor`` does those steps as transformers
does them, with the torch calls torchvision makes underneath on the CPU (a uint8 bicubic
``interpolate`` with antialiasing; ``(x - mean / scale) / (std / scale)`` in float32), and
reads the same ``video_preprocessor_config.json`` from the model's ``processor`` folder.
tests/families/test_minimax_h3_video_processor.py compares it with transformers' class where
torchvision imports.

``VisionProcessors`` hands it to diffusers' own ``_gather_vision_features`` beside Qwen3-VL's
image processor, in the shape of the ``Qwen3VLProcessor`` that function reads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ditserve.engine.errors import ModelLoadError

CONFIG_NAME = "video_preprocessor_config.json"  # transformers' file name for it
# PIL's resampling codes (transformers' ``resample``) and the torch modes torchvision maps
# them to; Qwen3-VL's is bicubic (3).
_MODES = {0: "nearest", 2: "bilinear", 3: "bicubic"}


def smart_resize(num_frames: int, height: int, width: int, *, temporal_factor: int,
                 factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' ``qwen3_vl`` ``smart_resize``: sides rounded to ``factor``, the clip's
    ``frames x height x width`` brought within [min_pixels, max_pixels] at its aspect."""
    if num_frames < temporal_factor:
        raise ValueError(f"{num_frames} frames are fewer than a temporal patch "
                         f"({temporal_factor})")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError("a video's aspect ratio must be below 200:1")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class VideoProcessor:
    """Qwen3-VL's video processor for frames already sampled (module docstring). Sizes are
    pixels of the whole clip (frames x height x width), as transformers' ``size`` holds."""

    min_pixels: int
    max_pixels: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = 3
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VideoProcessor:
        size = config.get("size") or {}
        if not (size.get("shortest_edge") and size.get("longest_edge")):
            raise ModelLoadError(f"{CONFIG_NAME}: size needs shortest_edge and longest_edge "
                                 f"(pixels of a clip), got {size}")
        resample = int(config.get("resample", 3))
        if resample not in _MODES:
            raise ModelLoadError(f"{CONFIG_NAME}: resample {resample} is not served "
                                 f"(nearest, bilinear or bicubic: {sorted(_MODES)})")
        fields = {name: config[name] for name in (
            "patch_size", "temporal_patch_size", "merge_size", "rescale_factor", "do_resize",
            "do_rescale", "do_normalize", "max_video_tokens") if config.get(name) is not None}
        for name in ("image_mean", "image_std"):
            value = config.get(name)
            if value is not None:
                fields[name] = tuple(float(v) for v in (value if isinstance(value, list)
                                                        else [value] * 3))
        return cls(min_pixels=int(size["shortest_edge"]), max_pixels=int(size["longest_edge"]),
                   resample=resample,
                   cap_pixels_per_frame=bool(config.get("cap_pixels_per_frame") or False),
                   **fields)

    def to_config(self) -> dict[str, Any]:
        """The ``video_preprocessor_config.json`` transformers' ``Qwen3VLVideoProcessor``
        reads back to the same processor."""
        return {"size": {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels},
                "patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
                "merge_size": self.merge_size, "image_mean": list(self.image_mean),
                "image_std": list(self.image_std), "rescale_factor": self.rescale_factor,
                "do_resize": self.do_resize, "do_rescale": self.do_rescale,
                "do_normalize": self.do_normalize, "resample": self.resample,
                "do_sample_frames": False, "cap_pixels_per_frame": self.cap_pixels_per_frame,
                "max_video_tokens": self.max_video_tokens,
                "video_processor_type": "Qwen3VLVideoProcessor",
                "processor_class": "Qwen3VLProcessor"}

    def __call__(self, videos: Sequence[Any], do_sample_frames: bool = False,
                 return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        """``pixel_values_videos`` (all videos' patches, one after another) and
        ``video_grid_thw`` (each video's temporal, height and width patch counts) of
        ``videos``: (frames, height, width, 3) uint8 arrays, frames already sampled."""
        if do_sample_frames or return_tensors != "pt":
            raise ValueError("this video processor takes sampled frames and returns torch "
                             "tensors")
        patches, grids = [], []
        for video in videos:
            frames = torch.as_tensor(video)
            if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
                raise ValueError(f"a video is (frames, height, width, 3) uint8, got "
                                 f"{tuple(frames.shape)} {frames.dtype}")
            clip = self._normalized(self._resized(frames.permute(0, 3, 1, 2).contiguous()))
            flat, grid = self._patches(clip)
            patches.append(flat)
            grids.append(grid)
        return {"pixel_values_videos": torch.cat(patches),
                "video_grid_thw": torch.tensor(grids)}

    def _resized(self, frames: torch.Tensor) -> torch.Tensor:
        """(T, 3, H, W) uint8 at ``smart_resize``'s size for T frames."""
        if not self.do_resize:
            return frames
        count, height, width = frames.shape[0], frames.shape[-2], frames.shape[-1]
        factor = self.patch_size * self.merge_size
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:  # transformers' per-frame cap (qwen-vl-utils')
            per_frame = max(min(self.max_video_tokens * factor * factor,
                                self.max_pixels // count), int(self.min_pixels * 1.05))
            max_pixels = per_frame * count
        size = smart_resize(count, height, width, temporal_factor=self.temporal_patch_size,
                            factor=factor, min_pixels=self.min_pixels, max_pixels=max_pixels)
        if size == (height, width):
            return frames
        mode = _MODES[self.resample]
        # torchvision resizes uint8 natively on the CPU for bicubic (and nearest); a float
        # pass rounds back to uint8 otherwise, as its fallback does.
        if mode == "bilinear":
            out = torch.nn.functional.interpolate(frames.float(), size=size, mode=mode,
                                                  antialias=True, align_corners=False)
            return out.round_().to(torch.uint8)
        return torch.nn.functional.interpolate(frames, size=size, mode=mode,
                                               antialias=mode != "nearest",
                                               **({} if mode == "nearest"
                                                  else {"align_corners": False}))

    def _normalized(self, frames: torch.Tensor) -> torch.Tensor:
        """float32, rescaled and normalized in one pass (transformers' fused form)."""
        pixels = frames.to(torch.float32)
        if self.do_normalize:
            mean, std = torch.tensor(self.image_mean), torch.tensor(self.image_std)
            if self.do_rescale:  # folded: the mean and std scaled up instead
                mean, std = mean * (1.0 / self.rescale_factor), std * (1.0 / self.rescale_factor)
            return pixels.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
        return pixels * self.rescale_factor if self.do_rescale else pixels

    def _patches(self, clip: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Qwen3-VL's patch layout of one (T, C, H, W) clip: (T' * h * w, C * t * p * p)
        rows, merge windows contiguous; the last frame repeated to fill a temporal patch."""
        t, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if pad := -clip.shape[0] % t:
            clip = torch.cat((clip, clip[-1:].expand(pad, -1, -1, -1)))
        frames, channels, height, width = clip.shape
        grid_t, grid_h, grid_w = frames // t, height // p, width // p
        blocks = clip.view(grid_t, t, channels, grid_h // m, m, p, grid_w // m, m, p)
        blocks = blocks.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return (blocks.reshape(grid_t * grid_h * grid_w, channels * t * p * p),
                [grid_t, grid_h, grid_w])


def load(folder: Path) -> VideoProcessor | None:
    """The processor folder's video processor, or None where it has no
    ``video_preprocessor_config.json`` (video references are then refused)."""
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not readable JSON ({e})") from e
    return VideoProcessor.from_config(config)


@dataclass(frozen=True)
class VisionProcessors:
    """Qwen3-VL's image and video processors, as diffusers' ``_gather_vision_features``
    reads them off a ``Qwen3VLProcessor``."""

    image_processor: Any
    video_processor: VideoProcessor | None
