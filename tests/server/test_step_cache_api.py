"""The step_cache extension field through the real server (tiny Flux): a cached request
answers, differs from the uncached one only slightly, and /metrics counts what it skipped;
a malformed field is a precise 400."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

GEN = "/v1/images/generations"


def image(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)


def test_cached_request_is_served_and_counted(server, metric) -> None:  # type: ignore[no-untyped-def]
    body = {"prompt": "a lighthouse", "seed": 5, "num_inference_steps": 8}
    before = metric(httpx.get(f"{server.url}/metrics").text,
                    "ditserve:step_cache_skipped_blocks_total")
    plain = image(httpx.post(f"{server.url}{GEN}", json=body, timeout=120))
    off = image(httpx.post(f"{server.url}{GEN}", json={**body, "step_cache": {
        "policy": "first-block", "threshold": 0}}, timeout=120))
    cached = image(httpx.post(f"{server.url}{GEN}", json={**body, "step_cache": {
        "policy": "every", "every": 2}}, timeout=120))
    assert np.array_equal(off, plain)  # threshold 0 is no cache
    assert 0 < np.abs(cached - plain).max() < 128
    metrics = httpx.get(f"{server.url}/metrics").text
    after = metric(metrics, "ditserve:step_cache_skipped_blocks_total")
    assert after - before == 10  # steps 3 and 5 of 8, all 5 blocks of the tiny Flux
    assert metric(metrics, "ditserve:step_cache_skipped_bytes_total") >= 0


@pytest.mark.parametrize(("field", "message"), [
    ({"policy": "sometimes"}, "step_cache: policy must be one of first-block, teacache, "
                              "every or 'none', got 'sometimes'"),
    ({"policy": "every", "threshold": 0.2}, "step_cache: threshold applies to first-block and "
                                            "teacache, not to 'every'"),
    (7, "step_cache: must be an object like {\"policy\": \"first-block\", \"threshold\": 0.08}, "
        "got int"),
])
def test_malformed_step_cache_is_a_precise_400(server, field, message) -> None:  # type: ignore[no-untyped-def]
    response = httpx.post(f"{server.url}{GEN}", json={"prompt": "x", "step_cache": field})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["message"]) == ("step_cache", message)
