"""What a Cosmos3 model writes and serves: an MP4 with its sound track, a one-frame request
as a PNG (the image route and ``generate``, equal to diffusers' num_frames=1 call), and a tiny
model's default request."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from families.cosmos3_support import (  # type: ignore[import-not-found]
    CASES,
    VARIANT,
    picture,
    reference,
)

from ditserve.engine.config import EngineConfig
from ditserve.engine.server.streaming import parse_sse


def test_generate_muxes_the_sound_track(family_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import av

    from ditserve.engine.cli.main import main

    out = tmp_path / "rain.mp4"
    code = main(["generate", "--model", str(family_dir(VARIANT)), "--device", "cpu",
                 "--prompt", "rain on a roof", "--steps", "2", "--seed", "4", "--height", "64",
                 "--width", "64", "--num-frames", "9", "--audio", "--out", str(out)])
    assert code == 0
    with av.open(str(out)) as container:
        assert container.streams.video[0].frames == 9
        sound = container.streams.audio[0]
        assert sound.codec_context.name == "aac" and sound.rate == 8000  # the tiny tokenizer's
        assert sound.channels == 2


def test_a_tiny_models_default_request_is_tiny(family_dir) -> None:  # type: ignore[no-untyped-def]
    """Cosmos3's DiT config names its width ``hidden_size``: a tiny one is read as a test
    model (64x64, 4 steps, a short clip), not given the released 1280x720x189 at 35 steps,
    which a bare ``ditserve generate`` on ``init-tiny --family cosmos3`` would run for hours on
    a CPU."""
    from ditserve.engine.families.defaults import TINY, TINY_VIDEO_FRAMES
    from ditserve.engine.server.model_defaults import model_defaults

    defaults = model_defaults(family_dir(VARIANT))
    assert defaults.output == "video"
    assert (defaults.width, defaults.height, defaults.steps) == (TINY.width, TINY.height,
                                                                 TINY.steps)
    assert defaults.frames == TINY_VIDEO_FRAMES


def test_the_released_width_is_not_a_test_models() -> None:
    from ditserve.engine.families.base import dit_width

    assert dit_width({"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 128}) == 4096


# Text-to-image as a user asks for it: an image, not a one-frame MP4.
T2I = CASES["t2i"]


def eight_bit(pixels: torch.Tensor) -> np.ndarray:
    """diffusers' [0, 1] pixels as the PNG writer rounds them (a 1e-3 difference may move a
    value across a rounding boundary: one level)."""
    from ditserve.engine.media.images import to_pil_images

    return np.asarray(to_pil_images(pixels)[0]).astype(np.int16)


def png_pixels(data: bytes) -> np.ndarray:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        assert (image.format, image.mode) == ("PNG", "RGB")
        return np.asarray(image).astype(np.int16)


def test_image_route_answers_the_one_frame_as_a_png(family_dir) -> None:  # type: ignore[no-untyped-def]
    """POST /v1/images/generations on a Cosmos3 replica, through the OpenAI SDK: the PNG is
    diffusers' num_frames=1 call; n=2 gives two; the card and the document say it is served."""
    import asyncio
    import base64

    import httpx
    import openai

    from ditserve.engine.loop.engine import DiffusionEngine
    from ditserve.engine.server.app import create_app
    from ditserve.engine.server.config import ServerConfig

    model = family_dir(VARIANT)
    engine = DiffusionEngine(EngineConfig(model=str(model), device="cpu")).start()
    app = create_app(engine, ServerConfig(model_name="cosmos3-tiny"), start_engine=False)

    async def script() -> tuple[Any, Any, dict[str, Any], dict[str, Any], str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused",
                                        http_client=http, max_retries=0)
            one = await client.images.generate(
                model="cosmos3-tiny", prompt=T2I.prompt, size="64x64",
                extra_body={"num_inference_steps": T2I.num_inference_steps, "seed": T2I.seed,
                            "guidance_scale": T2I.guidance_scale})
            two = await client.images.generate(
                model="cosmos3-tiny", prompt="a harbour", size="64x32", n=2,
                extra_body={"num_inference_steps": 2, "seed": 1})
            card = (await http.get("/v1/models/cosmos3-tiny")).json()
            streamed = await http.post("/v1/images/generations", json={
                "prompt": "a harbour", "size": "32x32", "stream": True, "partial_images": 1,
                "num_inference_steps": 2})
            return one, two, card, (await http.get("/openapi.json")).json(), streamed.text

    try:
        one, two, card, doc, streamed = asyncio.run(script())
    finally:
        app.state.server.stop()
    assert one.data is not None and len(one.data) == 1 and one.output_format == "png"
    got = png_pixels(base64.b64decode(one.data[0].b64_json or ""))
    want, _ = reference(model, T2I)  # (1, 1, 3, H, W)
    assert got.shape == (64, 64, 3)
    assert np.abs(got - eight_bit(want)).max() <= 1
    assert got.std() > 1  # not a constant image
    assert two.data is not None and len(two.data) == 2
    assert [png_pixels(base64.b64decode(d.b64_json or "")).shape for d in two.data] == \
        [(32, 64, 3)] * 2
    assert card["ditserve"]["output"] == "video" and card["ditserve"]["images"] is True
    assert {"/v1/images/generations", "/v1/videos"} <= set(doc["paths"])
    assert "ImageGenerationRequest" in doc["components"]["schemas"]
    images = [(kind, data) for kind, data in parse_sse(streamed)
              if kind.startswith("image_generation.")]  # between ditserve's progress events
    assert [kind for kind, _ in images] == ["image_generation.partial_image",
                                           "image_generation.completed"]
    assert all(png_pixels(base64.b64decode(data["b64_json"])).shape == (32, 32, 3)
               for _, data in images)


def test_generate_writes_a_png(family_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``generate --out x.png`` on a Cosmos3 model writes diffusers' num_frames=1 image (no
    --num-frames needed); an image cannot hold more frames or a sound track."""
    from ditserve.engine.cli.main import main

    model = family_dir(VARIANT)
    out = tmp_path / "lighthouse.png"
    common = ["generate", "--model", str(model), "--device", "cpu", "--prompt", T2I.prompt,
              "--steps", str(T2I.num_inference_steps), "--seed", str(T2I.seed),
              "--guidance-scale", str(T2I.guidance_scale), "--height", "64", "--width", "64"]
    assert main([*common, "--out", str(out)]) == 0
    want, _ = reference(model, T2I)
    assert np.abs(png_pixels(out.read_bytes()) - eight_bit(want)).max() <= 1
    for refused in (["--num-frames", "5"], ["--audio"]):
        assert main([*common, *refused, "--out", str(tmp_path / "no.png")]) == 2
    assert not (tmp_path / "no.png").exists()


def test_only_a_video_model_that_makes_still_images_writes_an_image(family_dir) -> None:  # type: ignore[no-untyped-def]
    """Cosmos3's defaults say it makes still images; a video model that does not (Wan) is
    refused an image ``--out`` before loading, as before."""
    from pathlib import Path

    from ditserve.engine.cli.generate import output_path
    from ditserve.engine.errors import ConfigError
    from ditserve.engine.server.model_defaults import model_defaults

    defaults = model_defaults(family_dir(VARIANT))
    assert defaults.output == "video" and defaults.still_images and defaults.makes_images
    out = Path("x.png")
    assert output_path(out, video=True, still_images=True) == out
    with pytest.raises(ConfigError, match="this is a video model"):
        output_path(out, video=True)


def test_an_input_image_for_one_frame_is_refused_not_ignored(family_dir) -> None:  # type: ignore[no-untyped-def]
    """diffusers' Cosmos3 pipeline makes a one-frame video from the text alone: an image sent
    with it (``input_reference`` and ``num_frames: 1``, ``generate --image`` to a .png) would be
    dropped without a word, so it is refused; two frames and more use it."""
    from ditserve.engine.errors import InvalidRequestError
    from ditserve.engine.loop.engine import DiffusionEngine
    from ditserve.engine.request import SamplingParams

    engine = DiffusionEngine(EngineConfig(model=str(family_dir(VARIANT)), device="cpu")).start()
    try:
        image = (picture(32, 32, seed=1),)
        with pytest.raises(InvalidRequestError, match="does not use an input image") as refused:
            engine.validate_params(SamplingParams(prompt="sea", height=32, width=32,
                                                  num_frames=1, images=image))
        assert refused.value.field == "image"
        assert engine.validate_params(SamplingParams(prompt="sea", height=32, width=32,
                                                     num_frames=5, images=image)).images
    finally:
        engine.shutdown()
