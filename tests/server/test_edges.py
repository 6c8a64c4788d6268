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
from ditserve.engine.adapters.config import AdapterConfig
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
