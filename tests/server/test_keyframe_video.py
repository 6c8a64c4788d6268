"""Keyframe video on a real server process (`ditserve serve` on the tiny MiniMax-H3): a
multipart body with ``input_reference`` (OpenAI's first frame) and ditserve's
``last_frame_reference`` beside it, a last frame alone in a JSON body, and the MP4 that
comes back."""

from __future__ import annotations

import base64
import io
import math
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types import Video
from PIL import Image
from server.video_support import mp4_facts

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
FRAMES = 124  # MiniMax-H3's shortest clip: 5 s at 24 fps


def png(width: int, height: int, color: tuple[int, int, int]) -> bytes:
    image = Image.new("RGB", (width, height), color)
    for x in range(width):
        image.putpixel((x, x % height), (250, 250, 20))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def keyframe_server(tmp_path_factory: pytest.TempPathFactory, launch_server) -> Iterator[object]:  # type: ignore[no-untyped-def]
    from ditserve.engine.makers.tiny_model import init_tiny

    tmp = tmp_path_factory.mktemp("keyframe-server")
    model = init_tiny(tmp / "model", family="minimax-h3")
    proc = launch_server(tmp, "--model", str(model), "--max-num-seqs", "2", "--max-side", "64",
                         "--max-steps", "4")
    yield proc
    proc.stop()


def wait_done(client: openai.OpenAI, video_id: str) -> Video:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        video = client.videos.retrieve(video_id)
        if video.status in ("completed", "failed"):
            return video
        time.sleep(0.2)
    raise AssertionError(f"video {video_id} did not finish")


def test_first_and_last_frame_files(keyframe_server) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=f"{keyframe_server.url}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    # The SDK sends one file (input_reference); the second part goes by hand, as a client
    # that knows ditserve's extension field would send it.
    files = {"input_reference": ("first.png", png(80, 40, (30, 120, 220)), "image/png"),
             "last_frame_reference": ("last.png", png(40, 40, (200, 40, 40)), "image/png")}
    response = httpx.post(f"{keyframe_server.url}/v1/videos", timeout=60, files=files, data={
        "prompt": "the ball rolls", "size": "64x32", "num_frames": str(FRAMES),
        "num_inference_steps": "2", "seed": "4"})
    assert response.status_code == 200, response.text
    done = wait_done(client, response.json()["id"])
    assert done.status == "completed", done.error
    facts = mp4_facts(client.videos.download_content(done.id).read())
    assert (facts["frames"], facts["width"], facts["height"]) == (FRAMES, 64, 32)


def test_a_last_frame_alone_in_json(keyframe_server) -> None:  # type: ignore[no-untyped-def]
    url = "data:image/png;base64," + base64.b64encode(png(64, 32, (10, 200, 90))).decode()
    response = httpx.post(f"{keyframe_server.url}/v1/videos", timeout=60, json={
        "prompt": "waves", "size": "64x32", "num_frames": FRAMES - 4, "num_inference_steps": 1,
        "last_frame_reference": {"image_url": url}})
    assert response.status_code == 200, response.text
    # 120 frames round up to 17 n + 5 as the VAE needs: the job says what its video will be.
    job = response.json()
    assert job["ditserve"]["num_frames"] == FRAMES and job["seconds"] == f"{FRAMES / 24:g}"
    client = openai.OpenAI(base_url=f"{keyframe_server.url}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    assert wait_done(client, response.json()["id"]).status == "completed"


def test_frame_counts_outside_the_models_clip_lengths_are_400(keyframe_server) -> None:  # type: ignore[no-untyped-def]
    # MiniMax-H3 generates 5 to 15 s at 24 fps, its count rounded up to 17n+5: these were
    # admitted and failed in the engine (a job "failed" with generation_failed).
    url = keyframe_server.url
    served = httpx.get(f"{url}/v1/models").json()["data"][0]["ditserve"]["limits"]
    assert (served["min_frames"], served["max_frames"]) == (120, 345)  # 346..360 -> 362
    shortest = served["min_frames"] / httpx.get(f"{url}/v1/models").json()["data"][0][
        "ditserve"]["defaults"]["fps"]
    for fields, param, said in (({"num_frames": "5"}, "num_frames", "120"),
                                ({"num_frames": "350"}, "num_frames", "345"),
                                ({"seconds": "1"}, "seconds", f"from {math.ceil(shortest)}")):
        response = httpx.post(f"{url}/v1/videos", timeout=60, data={
            "prompt": "waves", "size": "64x32", "num_inference_steps": "1", **fields})
        assert response.status_code == 400, (fields, response.text)
        error = response.json()["error"]
        assert error["param"] == param and said in error["message"], error
    response = httpx.post(f"{url}/v1/videos", timeout=60, json={
        "prompt": "waves", "size": "64x32", "num_inference_steps": 1, "seconds": 0.5})
    assert response.status_code == 400 and response.json()["error"]["param"] == "seconds"
