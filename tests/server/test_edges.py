"""Edges a new user runs into, in-process around the fake engine (issue 45): what an
unauthenticated client learns of unknown routes, the runtime LoRA routes of a server that
did not enable them, and an adapter loaded under the served model's name."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import httpx
import pytest

from ditserve.engine.adapters.catalog import AdapterCatalog
from ditserve.engine.config.adapters import AdapterConfig
from ditserve.engine.server.app import create_app
from ditserve.engine.server.config import ServerConfig

_spec = importlib.util.spec_from_file_location("server_fake_engine_edges",
                                               Path(__file__).with_name("fake_engine.py"))
assert _spec and _spec.loader
fake_engine = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fake_engine
_spec.loader.exec_module(fake_engine)
FakeEngine = fake_engine.FakeEngine

KEY = "edge-key"


def call(engine, *requests, config: ServerConfig | None = None):  # type: ignore[no-untyped-def]
    app = create_app(engine, config or ServerConfig(), start_engine=False)

    async def run():  # type: ignore[no-untyped-def]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.request(m, p, json=j, headers=h) for m, p, j, h in requests]

    return asyncio.run(run())


@pytest.mark.parametrize("method, path", [("GET", "/v1/nope"), ("POST", "/v1/models"),
                                          ("DELETE", "/v1/images/generations")])
def test_unknown_v1_routes_answer_401_before_404_or_405(method: str, path: str) -> None:
    bare, keyed = call(FakeEngine(), (method, path, None, {}),
                       (method, path, None, {"Authorization": f"Bearer {KEY}"}),
                       config=ServerConfig(api_key=KEY))
    assert bare.status_code == 401, bare.text
    assert bare.json()["error"]["code"] == "invalid_api_key"
    assert keyed.status_code in (404, 405)


def test_runtime_lora_routes_name_their_variable_when_off(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("DITSERVE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    body = {"lora_name": "x", "lora_path": "/x.safetensors"}
    load, unload = call(FakeEngine(), ("POST", "/v1/load_lora_adapter", body, {}),
                        ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}, {}))
    for answer in (load, unload):
        assert answer.status_code == 404
        assert "DITSERVE_ALLOW_RUNTIME_LORA_UPDATING=true" in answer.json()["error"]["message"]


def test_an_adapter_cannot_take_the_served_models_name(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("DITSERVE_ALLOW_RUNTIME_LORA_UPDATING", "true")
    engine = FakeEngine(adapters=AdapterCatalog(AdapterConfig(), inspect=lambda path: 4))
    (answer,) = call(engine, ("POST", "/v1/load_lora_adapter",
                              {"lora_name": "base", "lora_path": "/a.safetensors"}, {}),
                     config=ServerConfig(model_name="base"))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == ("lora_name", "adapter_name_taken")
    assert "base" not in engine.adapters


def test_a_huge_png_is_too_large_not_unknown() -> None:
    """A 30000x30000 PNG was "not a PNG, JPEG or WebP image" (PIL's own bound fired first)."""
    import struct
    import zlib

    from ditserve.engine.errors import InvalidRequestError
    from ditserve.engine.media.image_input import decode_image

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)  # 8-bit RGB
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")
    with pytest.raises(InvalidRequestError, match="pixels are accepted"):
        decode_image(png, max_pixels=4096 * 4096)


@pytest.mark.parametrize("path, size", [("/v1/images/generations", "100000x100000"),
                                        ("/v1/images/generations", "8x1234567"),
                                        ("/v1/videos", "100000x100000")])
def test_a_size_past_the_maximum_names_the_maximum(tmp_path: Path, path: str, size: str) -> None:
    from server.video_support import fake_video_engine  # type: ignore[import-not-found]

    engine = fake_video_engine(tmp_path) if "videos" in path else FakeEngine()
    (answer,) = call(engine, ("POST", path, {"prompt": "x", "size": size}, {}))
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert "between" in message and "WIDTHxHEIGHT" not in message


def test_the_sdks_bracketed_form_keys_fold_into_objects() -> None:
    from ditserve.engine.server.errors import APIError
    from ditserve.engine.server.fields.forms import fold_nested

    plain, folded = fold_nested([
        ("prompt", "x"), ("step_cache[policy]", "every"), ("step_cache[every]", "3"),
        ("loras[][name]", "a"), ("loras[][scale]", "0.5"), ("loras[][name]", "b"),
        ("image[]", "kept")])
    assert plain == [("prompt", "x"), ("image[]", "kept")]
    assert folded == {"step_cache": {"policy": "every", "every": 3},
                      "loras": [{"name": "a", "scale": 0.5}, {"name": "b"}]}
    for bad in ([("step_cache[every]", "often")], [("step_cache[colour]", "red")],
                [("loras[name]", "a")], [("step_cache", "every"), ("step_cache[every]", "2")]):
        with pytest.raises(APIError) as refused:
            fold_nested(bad)
        assert refused.value.status == 400


def test_sdk_video_job_with_extension_fields_in_extra_body(tmp_path: Path) -> None:
    """videos.create(extra_body={"step_cache": {...}, "loras": [...]}) sends a multipart
    form with bracketed keys; it was refused as unknown fields."""
    import openai
    from server.video_support import fake_video_engine, video_app  # type: ignore[import-not-found]

    catalog = AdapterCatalog(AdapterConfig(lora_modules={"style": "/style.safetensors"}),
                             inspect=lambda path: 4)
    engine = fake_video_engine(tmp_path, adapters=catalog)
    app, _ = video_app(engine)

    async def run() -> object:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused",
                                        http_client=http, max_retries=0)
            job = await client.videos.create(
                prompt="waves", size="32x16",  # type: ignore[arg-type]
                extra_body={"num_frames": 5, "num_inference_steps": 3,
                            "step_cache": {"policy": "every", "every": 3},
                            "loras": [{"name": "style", "scale": 0.5}]})
            return job

    try:
        asyncio.run(run())
    finally:
        app.state.server.videos.close()
    (params,) = engine.submitted
    assert (params.step_cache.policy, params.step_cache.every) == ("every", 3)
    assert [(ref.name, ref.scale) for ref in params.loras] == [("style", 0.5)]


def test_a_deadline_passed_mid_run_is_not_retried_by_the_sdk() -> None:
    from ditserve.engine.errors import DeadlineError
    from ditserve.engine.server.generation.waiting import failure as _failure

    app = create_app(FakeEngine(), ServerConfig(), start_engine=False)
    error = _failure(app.state.server, "rid", DeadlineError("late", started=True))
    assert (error.status, error.code) == (408, "deadline_exceeded")
    assert error.headers == {"x-should-retry": "false"}


def test_a_refused_adapter_at_start_logs_its_reason_without_a_traceback(caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    from ditserve.engine.errors import AdapterError

    engine = FakeEngine()

    def refuse() -> None:
        raise AdapterError("the adapter was trained for another model")

    engine.start = refuse  # type: ignore[method-assign]
    failures: list[BaseException] = []
    app = create_app(engine, ServerConfig(), start_engine=False,
                     on_start_failed=failures.append)
    with caplog.at_level(logging.INFO):
        app.state.server.start_engine()
    assert [str(e) for e in failures] == ["the adapter was trained for another model"]
    assert "Traceback" not in caplog.text
