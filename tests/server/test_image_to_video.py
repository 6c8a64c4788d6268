"""Image-to-video on a real server process (`ditserve serve` on the tiny Wan 2.1 I2V model):
the official OpenAI SDK's ``videos.create(..., input_reference=...)`` as a multipart file,
the JSON form with a data URL, and the refusals (no first frame, not an image)."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types import Video
from PIL import Image
from server.video_support import mp4_facts

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def png(width: int, height: int) -> bytes:
    image = Image.new("RGB", (width, height), (30, 120, 220))
    for x in range(width):
        image.putpixel((x, x % height), (250, 250, 20))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def i2v_server(tmp_path_factory: pytest.TempPathFactory, launch_server) -> Iterator[object]:  # type: ignore[no-untyped-def]
    from ditserve.engine.makers.tiny_model import init_tiny

    tmp = tmp_path_factory.mktemp("i2v-server")
    model = init_tiny(tmp / "model", family="wan-i2v")
    proc = launch_server(tmp, "--model", str(model), "--max-num-seqs", "2", "--max-side", "64",
                         "--max-steps", "4", "--max-frames", "17")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(i2v_server) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{i2v_server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def wait_done(client: openai.OpenAI, video_id: str) -> Video:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        video = client.videos.retrieve(video_id)
        if video.status in ("completed", "failed"):
            return video
        time.sleep(0.2)
    raise AssertionError(f"video {video_id} did not finish")


def test_sdk_create_with_input_reference(client) -> None:  # type: ignore[no-untyped-def]
    video = client.videos.create(prompt="the ball rolls", size="64x32", seconds="1",
                                 input_reference=("first.png", png(80, 40), "image/png"),
                                 extra_body={"num_inference_steps": 2, "seed": 4})
    assert isinstance(video, Video)
    assert (video.status, video.size) == ("queued", "64x32")
    done = wait_done(client, video.id)
    assert done.status == "completed", done.error
    facts = mp4_facts(client.videos.download_content(video.id).read())
    assert (facts["frames"], facts["width"], facts["height"]) == (17, 64, 32)


def test_json_body_with_a_data_url(i2v_server, client) -> None:  # type: ignore[no-untyped-def]
    url = "data:image/png;base64," + base64.b64encode(png(32, 32)).decode()
    response = httpx.post(f"{i2v_server.url}/v1/videos", timeout=60, json={
        "prompt": "waves", "size": "32x32", "num_frames": 5, "num_inference_steps": 1,
        "input_reference": {"image_url": url}})
    assert response.status_code == 200, response.text
    assert wait_done(client, response.json()["id"]).status == "completed"


@pytest.mark.parametrize(("body", "words"), [
    ({"prompt": "no frame", "size": "32x32"}, "needs 1 input image"),
    ({"prompt": "x", "input_reference": {"image_url": "https://example.com/a.png"}},
     "fetches no URLs"),
    ({"prompt": "x", "input_reference": {"image_url": "data:image/png;base64,aGVsbG8="}},
     "not a PNG, JPEG or WebP"),
])
def test_refusals_name_input_reference(i2v_server, body, words) -> None:  # type: ignore[no-untyped-def]
    response = httpx.post(f"{i2v_server.url}/v1/videos", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input_reference"
    assert words in error["message"]


def test_a_first_frame_model_refuses_a_last_frame(i2v_server) -> None:  # type: ignore[no-untyped-def]
    url = "data:image/png;base64," + base64.b64encode(png(32, 32)).decode()
    response = httpx.post(f"{i2v_server.url}/v1/videos", timeout=60, json={
        "prompt": "x", "size": "32x32", "num_frames": 5, "input_reference": {"image_url": url},
        "last_frame_reference": {"image_url": url}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "last_frame_reference"
    assert "takes no last frame" in error["message"]
