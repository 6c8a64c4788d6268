"""A multipart form's field given more than once is a 400 naming it, on both form routes (the
edits route and the video jobs), whichever field it is: a text field, or the edit's mask.
In-process around the fake engine: an editing (repainting) image model, and a video model."""

from __future__ import annotations

import asyncio
import dataclasses
import io
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from server.video_support import FakeEngine, fake_video_engine, run, video_app

from ditserve.engine.model_limits import ModelLimits
from ditserve.engine.server.app import create_app
from ditserve.engine.server.config import ServerConfig


@dataclasses.dataclass
class RepaintingEngine(FakeEngine):  # type: ignore[misc,valid-type]
    """The fake image model, taking up to two source images, a mask and a strength."""

    @property
    def limits(self) -> ModelLimits:
        return dataclasses.replace(super().limits, condition_images=(1, 2),
                                   image_strength=(0.6, 1.0))


def png() -> tuple[str, bytes, str]:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 40, 40)).save(out, format="PNG")
    return ("source.png", out.getvalue(), "image/png")


def edit(data: dict[str, Any], files: list[tuple[str, Any]]) -> httpx.Response:
    app = create_app(RepaintingEngine(), ServerConfig(), start_engine=False)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/images/edits", data=data, files=files)

    return asyncio.run(go())


def refused(response: httpx.Response, field: str) -> None:
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    assert response.json()["error"]["message"] == f"{field}: is given 2 times; give it once"


def test_an_edit_answers_when_each_field_is_given_once() -> None:
    response = edit({"prompt": "red", "num_inference_steps": "2"},
                    [("image", png()), ("mask", png())])
    assert response.status_code == 200, response.text


def test_an_edit_text_field_given_twice_is_refused() -> None:
    refused(edit({"prompt": ["red", "blue"]}, [("image", png())]), "prompt")


def test_an_edit_mask_given_twice_is_refused() -> None:
    refused(edit({"prompt": "red"}, [("image", png()), ("mask", png()), ("mask", png())]),
            "mask")


def test_a_video_job_form_field_given_twice_is_refused(tmp_path: Path) -> None:
    app, _ = video_app(fake_video_engine(tmp_path))

    async def script(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/videos", data={"prompt": "waves", "size": "32x16",
                                                      "num_frames": ["5", "9"]})

    refused(run(app, script), "num_frames")


@pytest.mark.parametrize(("source", "size"), [
    ((64, 64), "64x64"),  # the default's own shape
    ((128, 96), "64x48"),  # 4:3 at about the default's area, on the 16 px grid
    ((1, 300), "16x256"),  # a strip: the narrowest side the grid has, the rest at the area
    ((4000, 16), "256x16"),
])
def test_auto_size_keeps_the_default_area(source: tuple[int, int], size: str) -> None:
    from ditserve.engine.request import ConditionImage
    from ditserve.engine.server.edits.form import auto_size
    from ditserve.engine.server.limits import RequestLimits

    limits = RequestLimits("m", default_size=(64, 64), default_steps=4, pixel_multiple=16,
                           max_prompt_chars=None)
    width, height = source
    assert auto_size(ConditionImage(width, height, bytes(width * height * 3)), limits) == size
