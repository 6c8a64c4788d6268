"""The default server as a real process: batching equivalence, metrics, the bad-input
table, SSE progress, models/health/ready."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from ditserve.engine.server.streaming import parse_sse

GEN = "/v1/images/generations"
STEPS = [2, 9, 3, 8, 4, 7, 5, 6]


def decode_png(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def request_body(i: int) -> dict:
    return {"prompt": f"prompt number {i}", "seed": 100 + i, "num_inference_steps": STEPS[i],
            "size": "64x64"}


def test_concurrent_requests_equal_alone_and_batch(server, metric) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        alone = []
        for i in range(len(STEPS)):
            response = client.post(GEN, json=request_body(i))
            assert response.status_code == 200, response.text
            alone.append(response.json())

    async def concurrent() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            responses = await asyncio.gather(
                *(client.post(GEN, json=request_body(i)) for i in range(len(STEPS))))
        assert [r.status_code for r in responses] == [200] * len(STEPS)
        return [r.json() for r in responses]

    together = asyncio.run(concurrent())
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert b["ditserve"]["seed"] == 100 + i
        assert b["ditserve"]["num_inference_steps"] == STEPS[i]
        pa, pb = decode_png(a["data"][0]["b64_json"]), decode_png(b["data"][0]["b64_json"])
        assert pa.shape == (64, 64, 3)
        # PNG is uint8: "equal within float tolerance" means at most one level apart.
        assert np.abs(pa.astype(int) - pb.astype(int)).max() <= 1, f"request {i} differs"

    metrics = httpx.get(f"{server.url}/metrics").text
    steps = metric(metrics, "ditserve:step_batch_size_count")
    single = metric(metrics, 'ditserve:step_batch_size_bucket{le="1.0"}')
    assert steps > single, "no step ran with more than one request"
    assert metric(metrics, "ditserve:images_generated_total") >= 2 * len(STEPS)
    assert metric(metrics, "ditserve:e2e_request_latency_seconds_count") >= 2 * len(STEPS)
    assert metric(metrics, "ditserve:num_requests_running") == 0


LIMIT_PROMPT = "x" * 4001
FIELDS = ("prompt, model, n, size, response_format, user, stream, negative_prompt, "
          "num_inference_steps, guidance_scale, true_cfg_scale, seed")

BAD_INPUTS = [
    # (id, raw body, status, param, message)
    ("not-json", b"{prompt: 'cat'}", 400, None,
     "the request body is not valid JSON: Expecting property name enclosed in double quotes: "
     "line 1 column 2 (char 1)"),
    ("empty-body", b"", 400, None, "the request body is empty; send a JSON object"),
    ("array-body", b"[1, 2]", 400, None, "the request body must be a JSON object, got list"),
    ("missing-prompt", {"n": 1}, 422, "prompt", "prompt: is required"),
    ("prompt-type", {"prompt": 5}, 422, "prompt", "prompt: must be a string, got 5"),
    ("empty-prompt", {"prompt": "  "}, 422, "prompt", "prompt: must not be empty"),
    ("long-prompt", {"prompt": LIMIT_PROMPT}, 422, "prompt",
     "prompt: is 4001 characters; the limit is 4000"),
    ("unknown-field", {"prompt": "cat", "quality": "hd"}, 422, "quality",
     f"quality: unknown field; supported fields: {FIELDS}"),
    ("size-format", {"prompt": "cat", "size": "large"}, 422, "size",
     "size: must be 'WIDTHxHEIGHT' in pixels, e.g. '64x64', got 'large'"),
    ("size-multiple", {"prompt": "cat", "size": "30x64"}, 422, "size",
     "size: width must be a multiple of 4 for this model, got 30 (try 28 or 32)"),
    ("size-zero", {"prompt": "cat", "size": "64x0"}, 422, "size",
     "size: height must be between 4 and 8192, got 0"),
    ("size-huge", {"prompt": "cat", "size": "9000x64"}, 422, "size",
     "size: width must be between 4 and 8192, got 9000"),
    ("steps-zero", {"prompt": "cat", "num_inference_steps": 0}, 422, "num_inference_steps",
     "num_inference_steps: must be an integer in [1, 1000], got 0"),
    ("steps-string", {"prompt": "cat", "num_inference_steps": "4"}, 422, "num_inference_steps",
     "num_inference_steps: must be an integer, got '4'"),
    ("steps-float", {"prompt": "cat", "num_inference_steps": 4.5}, 422, "num_inference_steps",
     "num_inference_steps: must be an integer, got 4.5"),
    ("n-zero", {"prompt": "cat", "n": 0}, 422, "n", "n: must be an integer in [1, 8], got 0"),
    ("n-large", {"prompt": "cat", "n": 9}, 422, "n", "n: must be an integer in [1, 8], got 9"),
    ("guidance-negative", {"prompt": "cat", "guidance_scale": -1}, 422, "guidance_scale",
     "guidance_scale: must be in [0, 100], got -1.0"),
    ("guidance-string", {"prompt": "cat", "guidance_scale": "high"}, 422, "guidance_scale",
     "guidance_scale: must be a number, got 'high'"),
    ("guidance-nan", b'{"prompt": "cat", "guidance_scale": NaN}', 422, "guidance_scale",
     "guidance_scale: must be in [0, 100], got nan"),
    ("cfg-without-negative", {"prompt": "cat", "true_cfg_scale": 4}, 422, "true_cfg_scale",
     "true_cfg_scale: > 1 needs a negative_prompt (true CFG contrasts the two)"),
    ("seed-negative", {"prompt": "cat", "seed": -1}, 422, "seed",
     "seed: must be an integer in [0, 2^63), got -1"),
    ("stream-type", {"prompt": "cat", "stream": "yes"}, 422, "stream",
     "stream: must be true or false, got 'yes'"),
    ("response-format", {"prompt": "cat", "response_format": "url"}, 422, "response_format",
     "response_format: only 'b64_json' is supported (this server does not host image URLs), "
     "got 'url'"),
    ("unknown-model", {"prompt": "cat", "model": "dall-e-3"}, 404, "model",
     "model: 'dall-e-3' does not exist; this server serves 'ditserve-tiny-flux' "
     "(see GET /v1/models)"),
]


@pytest.mark.parametrize(("body", "status", "param", "message"),
                         [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_rejected_precisely(server, body, status, param, message) -> None:
    if isinstance(body, bytes):
        response = httpx.post(f"{server.url}{GEN}", content=body,
                              headers={"Content-Type": "application/json"})
    else:
        response = httpx.post(f"{server.url}{GEN}", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"] == message
    assert response.json()["error"]["param"] == param


def test_server_keeps_serving_after_bad_inputs(server, metric) -> None:
    for _, body, *_ in BAD_INPUTS:  # all of them again, back to back
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        assert httpx.post(f"{server.url}{GEN}", **kwargs).status_code in (400, 404, 422)
    response = httpx.post(f"{server.url}{GEN}", json={"prompt": "still here", "seed": 1},
                          timeout=60)
    assert response.status_code == 200
    assert len(response.json()["data"]) == 1
    metrics = httpx.get(f"{server.url}/metrics").text
    assert metric(metrics, 'ditserve:request_errors_total{reason="invalid_request"}') >= 20
    assert metric(metrics, 'ditserve:request_errors_total{reason="internal"}') == 0


def test_sse_stream_reports_every_step_then_the_image(server) -> None:
    body = {"prompt": "a streamed fox", "seed": 7, "num_inference_steps": 5, "n": 2}
    with httpx.stream("POST", f"{server.url}{GEN}", json={**body, "stream": True},
                      timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(response.read().decode())
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "image_generation.queued"
    assert events[0][1]["queue_position"] == 0 and events[0][1]["total_steps"] == 5
    progress = [data for kind, data in events if kind == "image_generation.progress"]
    assert [p["step"] for p in progress] == [1, 2, 3, 4, 5]
    assert all(p["total_steps"] == 5 for p in progress)
    assert kinds[-1] == "image_generation.completed"
    assert all(data["type"] == kind for kind, data in events)
    final = events[-1][1]
    assert final["ditserve"]["seed"] == 7 and len(final["data"]) == 2

    plain = httpx.post(f"{server.url}{GEN}", json=body, timeout=60).json()
    for streamed, direct in zip(final["data"], plain["data"], strict=True):
        diff = decode_png(streamed["b64_json"]).astype(int) - decode_png(direct["b64_json"])
        assert np.abs(diff).max() <= 1


def test_models_health_ready(server) -> None:
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["ditserve-tiny-flux"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{server.url}/ready")
    assert ready.status_code == 200
    body = ready.json()
    assert body["ready"] is True and body["phase"] == "ready"
    assert body["max_num_seqs"] == 4 and body["offload"] == {"enabled": False}
    unknown = httpx.get(f"{server.url}/v1/nothing")
    assert unknown.status_code == 404 and "error" in unknown.json()
    assert json.loads(httpx.get(f"{server.url}/openapi.json").text)["paths"]
