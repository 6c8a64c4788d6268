"""In-process (httpx ASGITransport, fake engine): what every answer gets from the edge - CORS,
/docs, the generic 500 for a bug, one error reason per cause - and the OpenAPI document's
promises (request body, error answers, media types), plus defaults read off a model dir."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import httpx
import pytest

from ditserve.engine.config import EngineConfig
from ditserve.engine.server.app import create_app
from ditserve.engine.server.config import ServerConfig
from ditserve.engine.server.limits import RequestLimits
from ditserve.engine.server.metrics import ServingMetrics
from ditserve.engine.server.model_defaults import model_defaults
from ditserve.engine.server.openapi import size_pattern
from ditserve.engine.server.state import engine_options

_spec = importlib.util.spec_from_file_location("server_fake_engine_edge",
                                               Path(__file__).with_name("fake_engine.py"))
assert _spec and _spec.loader
fake_engine = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fake_engine
_spec.loader.exec_module(fake_engine)
FakeEngine = fake_engine.FakeEngine

GEN = "/v1/images/generations"


def call(app, *requests):
    """(method, path, kwargs) requests against ``app``; returns the responses."""
    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.request(m, p, **kw) for m, p, kw in requests]

    return asyncio.run(run())


def app_for(engine=None, **config):
    return create_app(engine or FakeEngine(), ServerConfig(**config), start_engine=False)


def test_cors_is_off_by_default_and_answers_preflights_when_on() -> None:
    preflight = {"headers": {"Origin": "https://ui.example", "Access-Control-Request-Method":
                             "POST", "Access-Control-Request-Headers": "authorization"}}
    (off,) = call(app_for(), ("OPTIONS", GEN, preflight))
    assert off.status_code == 405 and "access-control-allow-origin" not in off.headers
    app = app_for(allowed_origins=("https://ui.example",))
    ok, other, simple = call(
        app, ("OPTIONS", GEN, preflight),
        ("OPTIONS", GEN, {"headers": {**preflight["headers"], "Origin": "https://evil.example"}}),
        ("POST", GEN, {"json": {"prompt": "cat"}, "headers": {"Origin": "https://ui.example"}}))
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://ui.example"
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert ok.headers["x-request-id"]  # a preflight is an answer too
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert simple.status_code == 200
    assert simple.headers["access-control-allow-origin"] == "https://ui.example"
    assert "X-Request-Id" in simple.headers["access-control-expose-headers"]


def test_docs_are_on_by_default_and_a_flag_turns_them_off() -> None:
    (docs,) = call(app_for(), ("GET", "/docs", {}))
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    no_docs, spec = call(app_for(docs=False), ("GET", "/docs", {}), ("GET", "/openapi.json", {}))
    assert no_docs.status_code == 404 and spec.status_code == 200


class Exploding(FakeEngine):  # type: ignore[misc, valid-type]
    def add_request(self, params, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("secret internal detail")


def test_a_bug_is_a_generic_500_with_the_request_id(caplog, metric) -> None:
    app = app_for(Exploding())
    response, metrics = call(app, ("POST", GEN, {"json": {"prompt": "cat"},
                                                 "headers": {"X-Request-Id": "r-500"}}),
                             ("GET", "/metrics", {}))
    assert response.status_code == 500 and response.headers["x-request-id"] == "r-500"
    assert response.json()["error"] == {
        "message": "internal server error (request r-500); see the server log",
        "type": "server_error", "param": None, "code": "internal_error"}
    assert "secret" not in response.text
    assert "request r-500: unhandled error in POST" in caplog.text
    assert "secret internal detail" in caplog.text
    assert metric(metrics.text, 'ditserve:request_errors_total{reason="internal"}') == 1


def test_each_error_counts_under_its_own_reason(metric) -> None:
    app = app_for(max_body_bytes=2048, api_key="k")
    auth = {"Authorization": "Bearer k"}
    cases = [
        ("POST", GEN, {"json": {"prompt": ""}, "headers": auth}, "invalid_request"),
        ("POST", GEN, {"json": {"prompt": "x", "model": "m"}, "headers": auth},
         "model_not_found"),
        ("GET", "/nowhere", {}, "not_found"),
        ("DELETE", "/health", {}, "method_not_allowed"),
        ("POST", GEN, {"json": {"prompt": "x"}}, "unauthorized"),
        ("POST", GEN, {"json": {"prompt": "x" * 4000}, "headers": auth}, "payload_too_large"),
        ("GET", "/health", {"headers": {"X-Request-Id": "a b"}}, "invalid_request"),
    ]
    *_, metrics = call(app, *[case[:3] for case in cases], ("GET", "/metrics", {}))
    for reason in {case[3] for case in cases}:
        expected = sum(case[3] == reason for case in cases)
        assert metric(metrics.text, f'ditserve:request_errors_total{{reason="{reason}"}}') \
            == expected, reason


def test_openai_routes_ditserve_leaves_out_say_so_not_404() -> None:
    # A 404 reads in the SDK as "that video does not exist" (NotFoundError).
    auth = {"Authorization": "Bearer k"}
    remix, variation, locked = call(
        app_for(api_key="k"),
        ("POST", "/v1/videos/video_abc/remix", {"json": {"prompt": "x"}, "headers": auth}),
        ("POST", "/v1/images/variations", {"files": {"image": ("a.png", b"x")},
                                           "headers": auth}),
        ("POST", "/v1/videos/video_abc/remix", {"json": {"prompt": "x"}}))
    for response, param, words in ((remix, "video_id", "remixing a finished video"),
                                   (variation, "image", "image variations")):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, "unsupported_value")
        assert error["message"].startswith(words) and "not supported by ditserve" in error[
            "message"]
    assert locked.status_code == 401  # the key is still asked for first


def test_a_queue_full_answer_is_429() -> None:
    (response,) = call(app_for(FakeEngine(outcome="queue_full")),
                       ("POST", GEN, {"json": {"prompt": "cat"}}))
    assert response.status_code == 429 and response.json()["error"]["code"] == "queue_full"
    assert response.headers["x-request-id"]


def test_openapi_documents_bodies_errors_and_media_types() -> None:
    (response,) = call(app_for(api_key="k", max_side=64), ("GET", "/openapi.json", {}))
    doc = response.json()
    paths = doc["paths"]
    generation = paths["/v1/images/generations"]["post"]
    body = generation["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ImageGenerationRequest"}
    request = doc["components"]["schemas"]["ImageGenerationRequest"]
    assert request["additionalProperties"] is False and request["required"] == ["prompt"]
    assert {"quality", "style", "output_format", "background", "moderation"} <= set(
        request["properties"])
    assert set(generation["responses"]) == {"200", "400", "401", "404", "408", "413", "429", "500",
                                            "503", "504"}
    assert set(generation["responses"]["200"]["content"]) == {"application/json",
                                                              "text/event-stream"}
    for path, operations in paths.items():
        for operation in operations.values():
            for status, answer in operation["responses"].items():
                assert "X-Request-Id" in answer["headers"], (path, status)
                if int(status) >= 400 and (path, status) != ("/ready", "503"):
                    assert answer["content"]["application/json"]["schema"] == {
                        "$ref": "#/components/schemas/Error"}, (path, status)
    metrics = paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    ready = paths["/ready"]["get"]["responses"]
    assert ready["503"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Readiness"}
    assert generation["security"] == [{"bearer": []}] and "security" not in paths["/health"]["get"]
    assert "/v1/models/{model_id}" in paths


def test_size_pattern_is_exactly_the_accepted_sizes() -> None:
    import re

    limits = RequestLimits(model_name="m", default_size=(64, 64), default_steps=4,
                           pixel_multiple=16, max_prompt_chars=None, max_side=64)
    pattern = re.compile(size_pattern(limits))
    accepted = {f"{w}x{h}" for w in (16, 32, 48, 64) for h in (16, 32, 48, 64)} | {"auto"}
    candidates = {f"{w}x{h}" for w in range(0, 81) for h in (0, 16, 17, 64, 80)}
    candidates |= {"064x64", "64X64", " 64x64", "64x64 ", "auto ", ""}
    assert {c for c in candidates | accepted if pattern.fullmatch(c)} == accepted


def _model_dir(tmp_path: Path, *, heads: int, head_dim: int, guidance: bool,
               sample_size: int | None) -> Path:
    root = tmp_path / "model"
    (root / "transformer").mkdir(parents=True)
    (root / "vae").mkdir()
    (root / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (root / "transformer" / "config.json").write_text(json.dumps(
        {"num_attention_heads": heads, "attention_head_dim": head_dim,
         "guidance_embeds": guidance}))
    vae = {} if sample_size is None else {"sample_size": sample_size}
    (root / "vae" / "config.json").write_text(json.dumps(vae))
    return root


@pytest.mark.parametrize(("heads", "head_dim", "guidance", "sample", "expected"), [
    (2, 16, True, 32, (64, 64, 4)),  # the tiny test model
    (24, 128, True, 1024, (1024, 1024, 28)),  # Flux.1-dev
    (24, 128, False, 1024, (1024, 1024, 4)),  # Flux.1-schnell (timestep-distilled)
    (24, 128, True, 32, (1024, 1024, 28)),  # a random full DiT with a tiny VAE
    (24, 128, True, None, (1024, 1024, 28)),
])
def test_defaults_come_from_the_model(tmp_path, heads, head_dim, guidance, sample,
                                      expected) -> None:
    root = _model_dir(tmp_path, heads=heads, head_dim=head_dim, guidance=guidance,
                      sample_size=sample)
    defaults = model_defaults(root)
    assert (defaults.width, defaults.height, defaults.steps) == expected


def test_the_server_uses_the_models_defaults(tmp_path, tiny_model_dir) -> None:
    assert (model_defaults(None).width, model_defaults(None).steps) == (64, 4)
    tiny = FakeEngine(config=EngineConfig(model=str(tiny_model_dir)))
    (response,) = call(create_app(tiny, ServerConfig(), start_engine=False),
                       ("POST", GEN, {"json": {"prompt": "cat", "size": "auto"}}))
    assert response.json()["size"] == "64x64"
    assert response.json()["ditserve"]["num_inference_steps"] == 4
    full = _model_dir(tmp_path, heads=24, head_dim=128, guidance=True, sample_size=1024)
    engine = FakeEngine(config=EngineConfig(model=str(full)))
    app = create_app(engine, ServerConfig(), start_engine=False)
    limits = app.state.server.limits()
    assert (limits.default_size, limits.default_steps) == ((1024, 1024), 28)
    # With --compile the warm-up compiles at the model's default size (no compile after ready).
    options = engine_options(engine.config, ServerConfig(), ServingMetrics(lambda: engine),
                             lambda: engine)
    assert options["warmup"].compile_size == (1024, 1024)


def test_odd_headers_paths_and_methods_are_client_errors() -> None:
    app = app_for(api_key="k")
    responses = call(
        app,
        ("GET", "/v1/models", {"headers": {"Authorization": b"Bearer \xff\xfe"}}),
        ("GET", "/health", {"headers": {"X-Request-Id": b"\xff"}}),
        ("GET", "/v1/models/%ff%00..%2f", {"headers": {"Authorization": "Bearer k"}}),
        ("GET", "/%00/../\\x", {}),
        ("BREW", "/health", {}),
        ("POST", GEN, {"content": b'{"prompt": "cat"}', "headers": {
            "Authorization": "Bearer k", "Content-Type": "text/plain; charset=latin-9"}}),
        ("POST", GEN, {"content": b"\x00" * 100, "headers": {"Authorization": "Bearer k"}}),
    )
    assert [r.status_code for r in responses] == [401, 400, 404, 404, 405, 200, 400]
    assert all(r.headers["x-request-id"] for r in responses)
