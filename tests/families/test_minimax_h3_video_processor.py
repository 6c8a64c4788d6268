"""Qwen3-VL's video processor without torchvision (``minimax_h3.video_processor``) against
transformers' own ``Qwen3VLVideoProcessor``.

transformers' class needs torchvision, which is not installable beside the CPU torch of this
project's machines: the whole-processor comparison runs where torchvision imports (the GPU
machine; a side environment with torch and torchvision from PyPI - docs/families.md says
how), the rest everywhere: the size rule against transformers' own ``smart_resize`` (a plain
function), the patch layout against the pixels it was cut from, the config's round trip."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from ditserve.engine.errors import ModelLoadError
from ditserve.engine.families.minimax_h3 import video_processor
from ditserve.engine.families.minimax_h3.video_processor import VideoProcessor, smart_resize

TINY = VideoProcessor(min_pixels=1024, max_pixels=16384)
RELEASED = VideoProcessor(min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32)


def clip(frames: int, height: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(frames, height, width, 3), dtype=np.uint8)


# Clips of the shapes diffusers' ref2va sampling hands over: 2 fps samples (2 to 31 frames)
# of tiny and released canvases, odd counts (the last frame repeated), sizes that upscale,
# downscale and stay.
CASES = [(TINY, [clip(11, 32, 64, 1)]), (TINY, [clip(2, 32, 32, 2), clip(5, 40, 72, 3)]),
         (TINY, [clip(3, 20, 90, 4)]), (RELEASED, [clip(9, 224, 384, 5)]),
         (RELEASED, [clip(30, 768, 1344, 6)[:, ::4, ::4].copy(), clip(4, 96, 160, 7)])]


def test_sizes_follow_transformers_smart_resize() -> None:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as theirs

    rng = random.Random(0)
    for _ in range(500):
        frames, height, width = rng.randint(2, 40), rng.randint(8, 1500), rng.randint(8, 1500)
        low = rng.choice([1024, 4096, 131072])
        high = rng.choice([16384, 786432, 25165824])
        kwargs = dict(temporal_factor=2, factor=32, min_pixels=low, max_pixels=high)
        assert smart_resize(frames, height, width, **kwargs) == \
            theirs(num_frames=frames, height=height, width=width, **kwargs)


def test_patches_hold_each_pixel_where_qwen3_vl_reads_it() -> None:
    processor = VideoProcessor(min_pixels=1, max_pixels=10**9, do_resize=False,
                               do_normalize=False, do_rescale=False)
    frames = clip(3, 64, 96, 8)  # 3 frames: the last repeated into the second patch
    out = processor([frames])
    grid = out["video_grid_thw"].tolist()
    assert grid == [[2, 4, 6]]
    patches = out["pixel_values_videos"].view(2, 2, 3, 2, 2, 3, 2, 16, 16)
    # (t, h / merge, w / merge, merge_h, merge_w, channel, frame in patch, row, column)
    pixels = torch.from_numpy(frames).permute(0, 3, 1, 2).float()  # (T, C, H, W)
    for t, bh, bw, mh, mw, c, f in [(0, 0, 0, 0, 0, 0, 0), (1, 1, 2, 1, 0, 2, 1),
                                    (0, 1, 1, 0, 1, 1, 1)]:
        frame = min(2 * t + f, 2)
        row, col = (2 * bh + mh) * 16, (2 * bw + mw) * 16
        assert torch.equal(patches[t, bh, bw, mh, mw, c, f],
                           pixels[frame, c, row:row + 16, col:col + 16])


def test_config_round_trip_and_refusals(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert video_processor.load(tmp_path) is None  # no file: video references refused
    (tmp_path / video_processor.CONFIG_NAME).write_text(json.dumps(TINY.to_config()))
    assert video_processor.load(tmp_path) == TINY
    with pytest.raises(ModelLoadError, match="shortest_edge"):
        VideoProcessor.from_config({"size": {"height": 4}})
    with pytest.raises(ModelLoadError, match="resample 1"):
        VideoProcessor.from_config({**TINY.to_config(), "resample": 1})


@pytest.mark.parametrize("case", range(len(CASES)))
def test_equals_transformers_video_processor(case: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("torchvision", reason="transformers' video processor needs torchvision")
    from transformers import Qwen3VLVideoProcessor

    ours, videos = CASES[case]
    (tmp_path / video_processor.CONFIG_NAME).write_text(json.dumps(ours.to_config()))
    theirs = Qwen3VLVideoProcessor.from_pretrained(str(tmp_path))
    expected = theirs(videos=list(videos), do_sample_frames=False, return_tensors="pt")
    got = ours(list(videos))
    assert torch.equal(got["video_grid_thw"], expected["video_grid_thw"])
    assert got["pixel_values_videos"].dtype == expected["pixel_values_videos"].dtype
    assert torch.equal(got["pixel_values_videos"], expected["pixel_values_videos"])
