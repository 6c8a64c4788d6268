"""The API in-process (httpx ASGITransport) around a fake engine: outcomes a real tiny model
cannot produce on demand - engine failures, hung requests (timeouts), a full queue, loading."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import sys
from pathlib import Path

import httpx
import pytest

from ditserve.engine.config import EngineConfig
from ditserve.engine.loop.lifecycle import EnginePhase
from ditserve.engine.server.app import create_app
from ditserve.engine.server.auth import check_bearer
from ditserve.engine.server.config import ServerConfig
from ditserve.engine.server.errors import APIError
from ditserve.engine.server.metrics import ServingMetrics
from ditserve.engine.server.state import engine_options
from ditserve.engine.server.streaming import parse_sse

_spec = importlib.util.spec_from_file_location("server_fake_engine",
                                               Path(__file__).with_name("fake_engine.py"))
assert _spec and _spec.loader
fake_engine = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fake_engine  # dataclasses look the module up while decorating
_spec.loader.exec_module(fake_engine)
FakeEngine = fake_engine.FakeEngine

GEN = "/v1/images/generations"


def call(engine, *requests, config: ServerConfig | None = None):
    """Run (method, path, json) requests against a fresh app; return the responses."""
    app = create_app(engine, config or ServerConfig(), start_engine=False)

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.request(m, p, json=j) for m, p, j in requests]

    return asyncio.run(run()), app


def test_engine_failure_is_a_500_for_that_request_only(metric, caplog) -> None:
    serving = ServingMetrics(lambda: engine)  # the engine's observer, as in a real server
    engine = FakeEngine(outcome="fail", observers=[serving])
    body = {"prompt": "cat"}

    async def run(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            failed = await client.post(GEN, json=body)
            engine.outcome = "finish"
            ok = await client.post(GEN, json=body)
            metrics = (await client.get("/metrics")).text
            return failed, ok, metrics

    app = create_app(engine, ServerConfig(), start_engine=False, serving_metrics=serving)
    failed, ok, metrics = asyncio.run(run(app))
    assert failed.status_code == 500
    assert failed.json()["error"]["code"] == "engine_error"
    rid = failed.headers["x-request-id"]
    # No internals in the answer; the cause is in the log, under the request id.
    assert failed.json()["error"]["message"] == (
        f"the engine failed to generate this request (request {rid}); see the server log")
    assert f"request {rid} failed: request {rid} failed: decode failed" in caplog.text
    assert ok.status_code == 200 and len(ok.json()["data"]) == 1
    assert metric(metrics, 'ditserve:request_errors_total{reason="engine_error"}') == 1
    assert metric(metrics, "ditserve:engine_request_failures_total") == 1
    assert metric(metrics, "ditserve:request_success_total") == 1


def test_timeout_aborts_the_request() -> None:
    engine = FakeEngine(outcome="hang")
    config = ServerConfig(request_timeout_s=0.05)
    (plain, streamed), _ = call(engine, ("POST", GEN, {"prompt": "cat"}),
                                ("POST", GEN, {"prompt": "cat", "stream": True}), config=config)
    assert plain.status_code == 504
    assert plain.json()["error"] == {
        "message": "the request did not finish within 0.05s and was aborted",
        "type": "server_error", "param": None, "code": "timeout"}
    events = parse_sse(streamed.text)
    assert [kind for kind, _ in events] == ["ditserve.queued", "error"]
    assert events[-1][1]["error"]["code"] == "timeout"
    assert [reason for _, reason in engine.aborted] == ["timed out", "timed out"]


def test_stream_reports_engine_failure_as_error_event() -> None:
    (response,), _ = call(FakeEngine(outcome="fail"),
                          ("POST", GEN, {"prompt": "cat", "stream": True}))
    events = parse_sse(response.text)
    assert events[-1][0] == "error"
    assert events[-1][1]["error"]["code"] == "engine_error"


def test_queue_full_is_429_with_retry_after() -> None:
    (response,), _ = call(FakeEngine(outcome="queue_full"), ("POST", GEN, {"prompt": "cat"}),
                          config=ServerConfig(retry_after_s=7))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "7"
    assert response.json()["error"]["type"] == "rate_limit_error"


def test_loading_engine_is_not_ready_and_refuses_work() -> None:
    (ready, gen, health), _ = call(FakeEngine(phase=EnginePhase.LOADING), ("GET", "/ready", None),
                                   ("POST", GEN, {"prompt": "cat"}), ("GET", "/health", None))
    assert ready.status_code == 503 and ready.json()["phase"] == "loading"
    assert gen.status_code == 503
    assert gen.json()["error"]["message"] == "the model is still loading; poll GET /ready"
    assert health.status_code == 200


def test_every_image_route_answers_a_loading_replica_with_503_not_a_verdict() -> None:
    """Before its model loaded, an engine knows neither its limits (a real one judges by the
    default ``ModelLimits``) nor its adapters nor whether it edits: a request during a
    restart is 503 ``model_loading`` with Retry-After, never a 4xx the client would not
    retry (as the videos route answers)."""
    from PIL import Image

    from ditserve.engine.model_limits import ModelLimits

    engine = FakeEngine(phase=EnginePhase.LOADING)
    engine.validate_params = lambda params: params.validate_for(ModelLimits())
    image = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 40, 40)).save(image, format="PNG")
    app = create_app(engine, ServerConfig(retry_after_s=3), start_engine=False)

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [
                await client.post(GEN, json={"prompt": "cat", "model": "style"}),
                await client.post(GEN, json={"prompt": "cat", "size": "36x36"}),
                await client.post("/v1/images/edits", data={"prompt": "red"},
                                  files={"image": ("cat.png", image.getvalue(), "image/png")}),
            ]

    for response in asyncio.run(run()):
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "3"
        assert response.json()["error"] == {
            "message": "the model is still loading; poll GET /ready", "type": "server_error",
            "param": None, "code": "model_loading"}


def test_ready_says_compiling_while_the_warm_up_compiles() -> None:
    engine = FakeEngine(phase=EnginePhase.COMPILING, config=EngineConfig(compile="inductor"))
    (ready, gen), _ = call(engine, ("GET", "/ready", None), ("POST", GEN, {"prompt": "cat"}))
    assert ready.status_code == 503
    assert (ready.json()["phase"], ready.json()["compile"]) == ("compiling", "inductor")
    assert gen.status_code == 503
    assert gen.json()["error"]["message"] == (
        "the DiT blocks are still compiling (--compile); poll GET /ready")


def test_metrics_export_each_ranks_copy_rate(metric) -> None:  # type: ignore[no-untyped-def]
    rank0 = {"bytes_transferred": 10, "pinned_host_bytes": 5, "h2d_gbps_recent": 55.1}
    offload = {**rank0, "ranks": [rank0, {"h2d_gbps_recent": 51.9}, {"h2d_gbps_recent": None}]}
    (response,), _ = call(FakeEngine(offload=offload), ("GET", "/metrics", None))
    text = response.text
    assert metric(text, 'ditserve:offload_h2d_bytes_per_second{rank="0"}') == 55.1e9
    assert metric(text, 'ditserve:offload_h2d_bytes_per_second{rank="1"}') == 51.9e9
    assert 'rank="2"' not in text  # nothing timed on that rank yet


def test_default_size_and_steps_follow_the_config() -> None:
    config = ServerConfig(default_size="32x48", default_steps=3)
    (response,), _ = call(FakeEngine(), ("POST", GEN, {"prompt": "cat", "seed": 5}),
                          config=config)
    meta = response.json()["ditserve"]
    assert meta["num_inference_steps"] == 3 and meta["seed"] == 5
    from base64 import b64decode
    from io import BytesIO

    from PIL import Image

    image = Image.open(BytesIO(b64decode(response.json()["data"][0]["b64_json"])))
    assert image.size == (32, 48)  # width x height


def test_the_models_default_size_fits_max_side_as_its_steps_fit_max_steps() -> None:
    """The model's 1024x1024 under --max-side 512 is 512x512 (aspect kept), not a default
    that runs past the bound a client's own size is held to."""
    from ditserve.engine.server.state import fitted_size

    assert fitted_size((1024, 1024), 512, 16) == (512, 512)
    assert fitted_size((1280, 720), 640, 16) == (640, 352)
    assert fitted_size((64, 64), 512, 16) == (64, 64)
    config = ServerConfig(max_side=32)  # the fake engine's model makes 64x64 by default
    (response,), _ = call(FakeEngine(), ("POST", GEN, {"prompt": "cat"}), config=config)
    from base64 import b64decode
    from io import BytesIO

    from PIL import Image

    image = Image.open(BytesIO(b64decode(response.json()["data"][0]["b64_json"])))
    assert image.size == (32, 32)


@pytest.mark.parametrize(("header", "ok"), [
    (None, False), ("", False), ("Bearer k", True), ("bearer k", True), ("Bearer k2", False),
    ("Basic k", False), ("Bearerk", False),
])
def test_check_bearer(header, ok) -> None:
    if ok:
        check_bearer(header, "k")
    else:
        with pytest.raises(APIError) as info:
            check_bearer(header, "k")
        assert info.value.status == 401
    check_bearer(header, None)  # auth off: anything passes


def test_plain_request_aborted_when_the_client_disconnects(metric) -> None:
    engine = FakeEngine(outcome="hang")
    app = create_app(engine, ServerConfig(), start_engine=False)
    incoming = [{"type": "http.request", "body": b'{"prompt": "cat"}', "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        # The body, then the client is gone (the handler has admitted the request by then).
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http", "path": GEN,
             "raw_path": GEN.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"test"),
                         (b"x-request-id", b"req-0")],
             "client": ("127.0.0.1", 1), "server": ("test", 80)}
    asyncio.run(app(scope, receive, send))
    (engine_id, reason), = engine.aborted
    # The engine's id carries the client's X-Request-Id (made unique: clients may reuse it).
    assert engine_id.startswith("req-0.") and reason == "client disconnected"
    assert sent[0]["status"] == 499
    text = app.state.server.metrics.render().decode()
    assert metric(text, 'ditserve:request_errors_total{reason="client_disconnect"}') == 1


def test_compile_warm_up_size_is_the_default_size_height_first() -> None:
    engine = FakeEngine()
    options = engine_options(engine.config, ServerConfig(default_size="128x64"),
                             ServingMetrics(lambda: engine), lambda: engine)
    # "WxH" in the API, (height, width) here
    assert options["warmup"].compile_size == (64, 128)
