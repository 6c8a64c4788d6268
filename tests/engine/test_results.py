"""GenerationResult: PIL images are made from the pixels on first use, not in the engine loop."""

from __future__ import annotations

import torch

from ditserve.engine.config import EngineConfig
from ditserve.engine.loop.engine import DiffusionEngine
from ditserve.engine.loop.results import GenerationResult
from ditserve.engine.media.images import to_pil_images
from ditserve.engine.request import SamplingParams


def test_images_are_converted_once_on_first_use() -> None:
    pixels = torch.rand(2, 3, 8, 12)
    result = GenerationResult("r", pixels, seed=1, num_inference_steps=2, queue_seconds=0.0,
                              latency_seconds=0.1)
    assert result.num_images == 2
    assert "images" not in result.__dict__  # nothing converted yet
    images = result.images
    assert result.images is images  # cached
    expected = to_pil_images(pixels)
    assert [im.tobytes() for im in images] == [im.tobytes() for im in expected]
    assert images[0].size == (12, 8)


def test_engine_hands_back_unconverted_results(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    engine = DiffusionEngine(EngineConfig(model=str(tiny_model_dir), device="cpu")).start()
    try:
        handle = engine.add_request(SamplingParams(prompt="a cat", num_inference_steps=2,
                                                   seed=3, num_images=2))
        result = handle.result(timeout=120)
    finally:
        engine.shutdown()
    # The loop thread did not spend time on PIL conversion; the caller's first use does it.
    assert "images" not in result.__dict__
    assert result.num_images == 2 and len(result.images) == 2
