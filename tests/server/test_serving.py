"""The default server as a real process: batching equivalence, metrics, the bad-input table
(the bodies that once answered 500 among them), SSE progress and partial images, ignored
OpenAI fields, request ids, the body limit, HEAD/Allow, models/health/ready."""

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
FIELDS = ("prompt, model, n, size, response_format, user, stream, partial_images, output_format, "
          "output_compression, background, moderation, quality, style, safety_identifier, "
          "negative_prompt, num_inference_steps, guidance_scale, true_cfg_scale, seed, "
          "max_sequence_length, loras, priority, deadline_s, step_cache")
HUGE = "9" * 5000

BAD_INPUTS = [
    # (id, raw body, status, param, message)
    ("not-json", b"{prompt: 'cat'}", 400, None,
     "the request body is not valid JSON: Expecting property name enclosed in double quotes: "
     "line 1 column 2 (char 1)"),
    ("empty-body", b"", 400, None, "the request body is empty; send a JSON object"),
    ("array-body", b"[1, 2]", 400, None, "the request body must be a JSON object, got list"),
    ("not-utf8", b'{"prompt": "\xff"}', 400, None, "the request body is not valid UTF-8 text"),
    # The four bodies that used to answer 500:
    ("huge-number", f'{{"prompt": "cat", "n": {HUGE}}}'.encode(), 400, None,
     "the request body holds a number with too many digits"),
    # A side of digits past the maximum names the range (issue 45), not the format.
    ("huge-size", {"prompt": "cat", "size": f"{HUGE}x64"}, 400, "size",
     "size: width and height must be between 4 and 64, got "
     f"'{HUGE[:37]}...{HUGE[:35]}x64'"),  # the 5 KB value cut to 80 characters
    ("deep-nesting", b'{"prompt": "cat", "user": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400,
     None, "the request body nests too deeply"),
    ("lone-surrogate", b'{"prompt": "a \\ud800 fox"}', 400, "prompt",
     "prompt: holds a lone UTF-16 surrogate at character 2; send valid Unicode text"),
    ("missing-prompt", {"n": 1}, 400, "prompt", "prompt: is required"),
    ("prompt-type", {"prompt": 5}, 400, "prompt", "prompt: must be a string, got 5"),
    ("empty-prompt", {"prompt": "  "}, 400, "prompt", "prompt: must not be empty"),
    ("long-prompt", {"prompt": LIMIT_PROMPT}, 400, "prompt",
     "prompt: is 4001 characters; the limit is 4000"),
    ("unknown-field", {"prompt": "cat", "colour": "red"}, 400, "colour",
     f"colour: unknown field; supported fields: {FIELDS}"),
    ("size-format", {"prompt": "cat", "size": "large"}, 400, "size",
     "size: must be 'WIDTHxHEIGHT' in pixels or 'auto', e.g. '64x64', got 'large'"),
    ("size-multiple", {"prompt": "cat", "size": "30x64"}, 400, "size",
     "size: width must be a multiple of 4 for this model, got 30 (try 28 or 32)"),
    ("size-zero", {"prompt": "cat", "size": "64x0"}, 400, "size",
     "size: height must be between 4 and 64, got 0"),
    ("size-over-limit", {"prompt": "cat", "size": "9000x64"}, 400, "size",
     "size: width must be between 4 and 64, got 9000"),
    ("steps-zero", {"prompt": "cat", "num_inference_steps": 0}, 400, "num_inference_steps",
     "num_inference_steps: must be an integer in [1, 10], got 0"),
    ("steps-over-limit", {"prompt": "cat", "num_inference_steps": 11}, 400,
     "num_inference_steps", "num_inference_steps: must be an integer in [1, 10], got 11"),
    ("steps-string", {"prompt": "cat", "num_inference_steps": "4"}, 400, "num_inference_steps",
     "num_inference_steps: must be an integer, got '4'"),
    ("steps-float", {"prompt": "cat", "num_inference_steps": 4.5}, 400, "num_inference_steps",
     "num_inference_steps: must be an integer, got 4.5"),
    ("n-zero", {"prompt": "cat", "n": 0}, 400, "n", "n: must be an integer in [1, 8], got 0"),
    ("n-large", {"prompt": "cat", "n": 9}, 400, "n", "n: must be an integer in [1, 8], got 9"),
    ("partial-images", {"prompt": "cat", "stream": True, "partial_images": 4}, 400,
     "partial_images", "partial_images: must be an integer in [0, 3], got 4"),
    ("guidance-negative", {"prompt": "cat", "guidance_scale": -1}, 400, "guidance_scale",
     "guidance_scale: must be in [0, 100], got -1.0"),
    ("guidance-string", {"prompt": "cat", "guidance_scale": "high"}, 400, "guidance_scale",
     "guidance_scale: must be a number, got 'high'"),
    ("guidance-nan", b'{"prompt": "cat", "guidance_scale": NaN}', 400, None,
     "the request body is not valid JSON: NaN is not a JSON number"),
    ("guidance-huge", f'{{"prompt": "cat", "guidance_scale": 1{"0" * 400}}}'.encode(), 400,
     "guidance_scale", f"guidance_scale: is out of range, got 1{'0' * 17}...{'0' * 19}"),
    ("text-too-long", {"prompt": "cat", "max_sequence_length": 513}, 400, "max_sequence_length",
     "max_sequence_length: must be an integer in [1, 512] for this model, got 513"),
    ("seed-negative", {"prompt": "cat", "seed": -1}, 400, "seed",
     "seed: must be an integer in [0, 2^63), got -1"),
    ("stream-type", {"prompt": "cat", "stream": "yes"}, 400, "stream",
     "stream: must be true or false, got 'yes'"),
    ("ignored-field-type", {"prompt": "cat", "quality": 5}, 400, "quality",
     "quality: must be one of 'auto', 'low', 'medium', 'high', 'standard' or 'hd', got 5"),
    ("output-compression", {"prompt": "cat", "output_compression": 101}, 400,
     "output_compression", "output_compression: must be an integer in [0, 100], got 101"),
    ("response-format", {"prompt": "cat", "response_format": "url"}, 400, "response_format",
     "response_format: only 'b64_json' is supported (this server does not host image URLs), "
     "got 'url'"),
    ("unknown-model", {"prompt": "cat", "model": "dall-e-3"}, 404, "model",
     "model: 'dall-e-3' does not exist; this server serves 'ditserve-tiny-flux' "
     "(see GET /v1/models)"),
]


def post(server, body, **kwargs) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{server.url}{GEN}", content=body,
                          headers={"Content-Type": "application/json", **kwargs.pop("headers", {})},
                          **kwargs)
    return httpx.post(f"{server.url}{GEN}", json=body, **kwargs)


@pytest.mark.parametrize(("body", "status", "param", "message"),
                         [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_rejected_precisely(server, body, status, param, message) -> None:
    response = post(server, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"] == message
    assert response.json()["error"]["param"] == param
    assert len(response.content) < 1000  # echoes are capped


def test_server_keeps_serving_after_bad_inputs(server, metric) -> None:
    invalid = 'ditserve:request_errors_total{reason="invalid_request"}'
    not_found = 'ditserve:request_errors_total{reason="model_not_found"}'

    def counts() -> tuple[float, float]:
        # Counted from this test's own requests: under pytest-xdist the server fixture's
        # other tests may have run in another worker, against another server.
        text = httpx.get(f"{server.url}/metrics").text
        return tuple(metric(text, name) if f"{name} " in text else 0.0  # type: ignore[return-value]
                     for name in (invalid, not_found))

    before = counts()
    for _, body, *_ in BAD_INPUTS:  # all of them, back to back
        assert post(server, body).status_code in (400, 404)
    response = httpx.post(f"{server.url}{GEN}", json={"prompt": "still here", "seed": 1},
                          timeout=60)
    assert response.status_code == 200
    assert len(response.json()["data"]) == 1
    after = counts()
    assert after[0] - before[0] >= 30  # of the 34 bad inputs answered 400
    assert after[1] - before[1] >= 1
    metrics = httpx.get(f"{server.url}/metrics").text
    assert metric(metrics, 'ditserve:request_errors_total{reason="internal"}') == 0


def test_sse_stream_reports_steps_partial_images_then_each_image(server) -> None:
    body = {"prompt": "a streamed fox", "seed": 7, "num_inference_steps": 6, "n": 2}
    with httpx.stream("POST", f"{server.url}{GEN}",
                      json={**body, "stream": True, "partial_images": 2}, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        rid = response.headers["x-request-id"]
        events = parse_sse(response.read().decode())
    kinds = [kind for kind, _ in events]
    assert events[0] == ("ditserve.queued", ["queued", 0, 6])  # next in line, 6 steps
    # Previews after steps 2 and 4 (evenly spaced, never the last), one event per image.
    assert [(k, d[1] if k == "ditserve.progress" else d.get("step"))
            for k, d in events[1:-2]] == [
        ("ditserve.progress", 1), ("ditserve.progress", 2),
        ("image_generation.partial_image", 2), ("image_generation.partial_image", 2),
        ("ditserve.progress", 3), ("ditserve.progress", 4),
        ("image_generation.partial_image", 4), ("image_generation.partial_image", 4),
        ("ditserve.progress", 5), ("ditserve.progress", 6)]
    assert all(d == ["step", d[1], 6] for k, d in events if k == "ditserve.progress")
    partial = [d for k, d in events if k == "image_generation.partial_image"]
    assert [(d["partial_image_index"], d["image_index"]) for d in partial] == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(d["size"] == "64x64" and d["output_format"] == "png" for d in partial)
    assert decode_png(partial[0]["b64_json"]).shape == (64, 64, 3)
    assert kinds[-2:] == ["image_generation.completed"] * 2
    assert all(data["type"] == kind and data["request_id"] == rid
               for kind, data in events if not kind.startswith("ditserve."))
    completed = [d for k, d in events[-2:]]
    assert [d["image_index"] for d in completed] == [0, 1]
    assert completed[0]["ditserve"]["seed"] == 7
    assert completed[0]["usage"]["output_tokens"] == 256  # (64/4)^2 image tokens per image

    plain = httpx.post(f"{server.url}{GEN}", json=body, timeout=60).json()
    assert plain["usage"]["output_tokens"] == 512 and plain["size"] == "64x64"
    for streamed, direct in zip(completed, plain["data"], strict=True):
        diff = decode_png(streamed["b64_json"]).astype(int) - decode_png(direct["b64_json"])
        assert np.abs(diff).max() <= 1  # previews did not change the result
    assert np.abs(decode_png(partial[2]["b64_json"]).astype(int)
                  - decode_png(completed[0]["b64_json"])).max() > 1  # a preview is not final


def test_openai_fields_that_do_not_apply_are_accepted_and_ignored(server) -> None:
    body = {"prompt": "a fox", "seed": 3, "size": "auto", "quality": "hd", "style": "vivid",
            "background": "opaque", "moderation": "low", "output_compression": 50,
            "safety_identifier": "u1", "user": "u1", "response_format": None, "n": None}
    response = post(server, body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    assert (data["size"], data["output_format"], data["background"]) == ("64x64", "png", "opaque")
    plain = post(server, {"prompt": "a fox", "seed": 3}, timeout=60).json()
    assert data["data"] == plain["data"]  # the ignored fields changed nothing


@pytest.mark.parametrize(("output_format", "pil_format"), [("jpeg", "JPEG"), ("webp", "WEBP")])
def test_output_format_writes_the_images_in_it(server, output_format, pil_format) -> None:
    png = Image.fromarray(decode_png(post(server, {"prompt": "a fox", "seed": 3}, timeout=60)
                                     .json()["data"][0]["b64_json"]))
    sizes = []
    for compression in (90, 10):
        response = post(server, {"prompt": "a fox", "seed": 3, "output_format": output_format,
                                 "output_compression": compression}, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["output_format"] == output_format
        raw = base64.b64decode(response.json()["data"][0]["b64_json"])
        image = Image.open(io.BytesIO(raw))
        assert (image.format, image.size, image.mode) == (pil_format, (64, 64), "RGB")
        sizes.append(len(raw))
        # The same picture as the PNG, written by the encoder at output_compression quality.
        again = io.BytesIO()
        png.save(again, format=pil_format, quality=compression)
        assert np.array_equal(np.asarray(image), np.asarray(Image.open(again)))
    assert sizes[1] < sizes[0]  # output_compression is the quality the encoder used
    streamed = post(server, {"prompt": "a fox", "seed": 3, "stream": True, "partial_images": 1,
                             "num_inference_steps": 2, "output_format": output_format},
                    timeout=60)
    images = [e for _, e in parse_sse(streamed.text) if isinstance(e, dict) and "b64_json" in e]
    assert len(images) == 2  # a preview and the final image, both in the format asked for
    for event in images:
        assert event["output_format"] == output_format
        assert Image.open(io.BytesIO(base64.b64decode(event["b64_json"]))).format == pil_format


@pytest.mark.parametrize(("field", "value", "message"), [
    ("background", "transparent", "background: 'transparent' is not available"),
    ("output_format", "gif", "output_format: "),
    ("quality", "bogus", "quality: "),
    ("moderation", "strict", "moderation: "),
    ("style", "bold", "style: "),
])
def test_openai_enumerated_fields_take_openais_values(server, field, value, message) -> None:
    response = post(server, {"prompt": "a fox", field: value}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(message), error
    assert repr(value) in error["message"]


def test_request_ids_on_every_answer_and_in_the_log(server) -> None:
    ok = post(server, {"prompt": "cat", "num_inference_steps": 1}, timeout=60)
    made = ok.headers["x-request-id"]
    assert len(made) == 32 and ok.json()["ditserve"]["request_id"] == made
    mine = post(server, {"prompt": "cat", "num_inference_steps": 1},
                headers={"X-Request-Id": "client-id-1"}, timeout=60)
    assert mine.headers["x-request-id"] == "client-id-1"
    assert mine.json()["ditserve"]["request_id"] == "client-id-1"
    again = post(server, {"prompt": "cat", "num_inference_steps": 1},
                 headers={"X-Request-Id": "client-id-1"}, timeout=60)  # reuse is fine
    assert again.status_code == 200
    for response in (post(server, {"prompt": ""}, headers={"X-Request-Id": "bad-input-7"}),
                     httpx.get(f"{server.url}/nowhere", headers={"X-Request-Id": "lost-8"}),
                     httpx.get(f"{server.url}/health")):
        assert response.headers["x-request-id"]
    bad = httpx.get(f"{server.url}/health", headers={"X-Request-Id": "has space"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
    assert len(bad.headers["x-request-id"]) == 32
    log = server.log_text()
    assert "request bad-input-7: 400 invalid_value: prompt: must not be empty" in log
    assert "request lost-8: 404 not_found" in log


def test_body_over_the_limit_is_413(server, metric) -> None:
    before = metric(httpx.get(f"{server.url}/metrics").text,
                    'ditserve:request_errors_total{reason="payload_too_large"}')
    response = post(server, {"prompt": "x" * 70_000})  # the server takes 64 KiB
    assert response.status_code == 413
    assert response.json()["error"] == {
        "message": "the request body is larger than 65536 bytes", "type": "invalid_request_error",
        "param": None, "code": "body_too_large"}
    chunked = httpx.post(f"{server.url}{GEN}", content=iter([b'{"prompt": "', b"x" * 70_000]),
                         headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413  # no Content-Length: counted while read
    after = metric(httpx.get(f"{server.url}/metrics").text,
                   'ditserve:request_errors_total{reason="payload_too_large"}')
    assert after - before == 2


def test_head_allow_and_models(server) -> None:
    head = httpx.head(f"{server.url}/health")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == str(len(b'{"status":"ok"}'))
    wrong = httpx.put(f"{server.url}/health")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, HEAD"
    assert httpx.get(f"{server.url}{GEN}").headers["allow"] == "POST"
    model = httpx.get(f"{server.url}/v1/models/ditserve-tiny-flux").json()
    assert (model["id"], model["object"]) == ("ditserve-tiny-flux", "model")
    missing = httpx.get(f"{server.url}/v1/models/dall-e-3")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


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
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
    assert json.loads(httpx.get(f"{server.url}/openapi.json").text)["paths"]
    assert httpx.get(f"{server.url}/docs").status_code == 200
