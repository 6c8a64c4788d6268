"""Requests the loaded model (or the server's store) cannot run are refused up front, through
real HTTP.

The tiny Wan's rope table holds 32 positions per axis (``rope_max_seq_len``), in patches: at
16 pixels per patch (8x VAE, 2x2 patches) that is 512 pixels a side, and at 4 frames per
latent frame 125 frames. Its server here sets no --max-side or --max-frames, so the model's
own limits are the bounds: they show in /v1/models/{id} and in the OpenAPI document, a
request past them is a 400 with OpenAI's error object (it used to be accepted, then failed
in the forward), and the largest request they allow completes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from ditserve.engine.request import MAX_SIDE

TINY_WAN_SIDE, TINY_WAN_FRAMES = 32 * 16, 31 * 4 + 1
STORE_BYTES = 4 << 20  # the video store of the server below: 4 MiB


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK's videos


@pytest.fixture(scope="module")
def wan_server(tmp_path_factory, tiny_wan, launch_server) -> Iterator[object]:
    proc = launch_server(tmp_path_factory.mktemp("limits"), "--model", str(tiny_wan),
                         "--max-steps", "2", "--video-max-bytes", str(STORE_BYTES),
                         "--video-dir", str(tmp_path_factory.mktemp("limits-videos")))
    yield proc
    proc.stop()


def test_the_model_card_shows_the_models_own_limits(wan_server) -> None:
    card = httpx.get(f"{wan_server.url}/v1/models/model").json()
    served = card["ditserve"]
    assert served["output"] == "video" and served["loaded"] is True
    assert served["images"] is False  # Wan makes no still images: the image route is a 400
    limits = served["limits"]
    assert (limits["pixel_multiple"], limits["positions"]) == (16, 32)
    assert (limits["max_width"], limits["max_height"]) == (TINY_WAN_SIDE, TINY_WAN_SIDE)
    assert (limits["frame_step"], limits["max_frames"]) == (4, TINY_WAN_FRAMES)
    assert served["adapters"] == []
    listed = httpx.get(f"{wan_server.url}/v1/models").json()["data"]
    assert listed == [card]


def test_the_openapi_document_holds_the_same_limits(wan_server) -> None:
    schemas = httpx.get(f"{wan_server.url}/openapi.json").json()["components"]["schemas"]
    body = schemas["VideoCreateRequest"]["properties"]
    size = re.compile(body["size"]["anyOf"][0]["pattern"])
    assert size.match(f"{TINY_WAN_SIDE}x16") and not size.match(f"{TINY_WAN_SIDE + 16}x16")
    frames = body["num_frames"]["anyOf"][0]["enum"]
    assert max(frames) == TINY_WAN_FRAMES
    assert "512" in body["size"]["anyOf"][0]["description"]


@pytest.mark.parametrize(("field", "value", "words"), [
    ("size", "528x16", f"between 16 and {TINY_WAN_SIDE}"),
    ("size", "16x8192", f"between 16 and {TINY_WAN_SIDE}"),
    ("num_frames", 129, f"and {TINY_WAN_FRAMES}"),
    ("num_frames", 1025, f"and {TINY_WAN_FRAMES}"),
    ("seconds", "8", "whole seconds from 1 to 7"),
    ("seconds", 8.0, "at most 7.8125"),
])
def test_a_request_past_the_models_limits_is_a_400_up_front(wan_server, field, value,
                                                            words) -> None:
    response = httpx.post(f"{wan_server.url}/v1/videos",
                          json={"prompt": "waves", field: value}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"], error["code"]) == (
        field, "invalid_request_error", "invalid_value")
    assert words in error["message"]
    assert httpx.get(f"{wan_server.url}/v1/videos").json()["data"] == []  # no job was made


def test_the_docs_example_is_refused_on_the_tiny_model(wan_server) -> None:
    # docs/serving.md's Python example (832x480, 5 s) is for a real Wan; the tiny one says why.
    response = httpx.post(f"{wan_server.url}/v1/videos",
                          data={"prompt": "a fox", "size": "832x480", "seconds": "5"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "size"


@pytest.mark.parametrize(("size", "frames"), [(f"{TINY_WAN_SIDE}x16", 1),
                                             ("16x16", TINY_WAN_FRAMES)])
def test_the_largest_requests_the_limits_allow_complete(wan_server, size, frames) -> None:
    response = httpx.post(f"{wan_server.url}/v1/videos", json={
        "prompt": "a long thin strip", "size": size, "num_frames": frames, "fps": 16,
        "num_inference_steps": 1, "seed": 3})
    assert response.status_code == 200, response.text
    video_id = response.json()["id"]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # another process: poll the job
        job = httpx.get(f"{wan_server.url}/v1/videos/{video_id}").json()
        if job["status"] in ("completed", "failed"):
            break
        time.sleep(0.2)
    assert job["status"] == "completed", job
    assert (job["size"], job["ditserve"]["num_frames"]) == (size, frames)


def test_an_image_replica_shows_its_limits_too(server) -> None:
    served = httpx.get(f"{server.url}/v1/models/ditserve-tiny-flux").json()["ditserve"]
    assert served["output"] == "image"
    # Flux computes its rope from the token ids (no table): the server's --max-side (64)
    # is the bound, and nothing bigger than MAX_SIDE ever is.
    assert served["limits"]["positions"] is None
    assert served["limits"]["max_width"] == 64 < MAX_SIDE
    assert "frame_step" not in served["limits"]


def test_a_job_that_can_never_fit_the_store_is_a_400_not_a_429(wan_server) -> None:
    # 512 x 512 x 125 frames reserves 98 MB: more than the whole 4 MiB store. A 429 would
    # send the SDK into retries (with a Retry-After of half an hour) for nothing.
    client = openai.OpenAI(base_url=f"{wan_server.url}/v1", api_key="unused", max_retries=3)
    with pytest.raises(openai.BadRequestError) as refused:
        client.videos.create(prompt="too big", size=f"{TINY_WAN_SIDE}x{TINY_WAN_SIDE}",
                             extra_body={"num_frames": TINY_WAN_FRAMES})
    error = refused.value.body
    assert (error["param"], error["code"]) == ("size", "exceeds_store")
    assert "can never fit" in error["message"] and str(STORE_BYTES) in error["message"]
    assert "retry-after" not in refused.value.response.headers
