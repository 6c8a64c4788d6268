"""LoRA adapters over HTTP, against `ditserve serve --lora-modules` as a real process:
selection by ``model`` and by ``loras``, ``/v1/models``, vLLM's load / unload routes behind
the API key, OpenAI error objects for unknown adapters and for an unload while in use, and
the adapters' bytes in /metrics."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from adapters.lora_files import peft_lora  # type: ignore[import-not-found]
from PIL import Image
from server.conftest import metric_value, start_server  # type: ignore[import-not-found]

from ditserve.engine.server.streaming import parse_sse

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GEN = "/v1/images/generations"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, dict[str, Path]]]:
    from diffusers import FluxTransformer2DModel

    from ditserve.engine.makers.tiny_model import init_tiny

    tmp = tmp_path_factory.mktemp("lora-server")
    model = init_tiny(tmp / "model", family="flux")
    dit = FluxTransformer2DModel.from_pretrained(model / "transformer")
    files = {"style": peft_lora(dit, tmp / "style.safetensors", rank=4, seed=1, std=0.6),
             "extra": peft_lora(dit, tmp / "extra.safetensors", rank=8, seed=2,
                                targets=("to_q", "proj_mlp"))}
    server = start_server(tmp, "--model", str(model), "--lora-modules",
                          f"style={files['style']}", "--max-steps", "400",
                          env={"DITSERVE_API_KEY": KEY,
                               "DITSERVE_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    yield server, files
    server.stop()


def tmp_text(path: Path) -> Path:
    path.write_text("not an adapter")
    return path


def image(body: dict[str, object], server) -> np.ndarray:  # type: ignore[no-untyped-def]
    response = httpx.post(f"{server.url}{GEN}", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    raw = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB")).astype(int)


def test_models_list_adapters_with_parent(lora_server) -> None:  # type: ignore[no-untyped-def]
    server, _ = lora_server
    data = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]
    base, adapter = data[0], data[1]
    assert adapter["id"] == "style" and adapter["parent"] == base["id"]
    assert httpx.get(f"{server.url}/v1/models/style", headers=AUTH).json()["parent"] == base["id"]


def test_model_name_selects_the_adapter_at_scale_one(lora_server) -> None:  # type: ignore[no-untyped-def]
    server, _ = lora_server
    body = {"prompt": "a red fox", "seed": 5, "num_inference_steps": 3, "size": "64x64"}
    by_model = image({**body, "model": "style"}, server)
    by_field = image({**body, "loras": [{"name": "style", "scale": 1.0}]}, server)
    base = image(body, server)
    half = image({**body, "loras": [{"name": "style", "scale": 0.5}]}, server)
    assert np.abs(by_model - by_field).max() <= 1
    assert np.abs(by_model - base).max() > 4  # the adapter changed the image
    assert np.abs(half - by_model).max() > 1  # and its scale matters


def test_unknown_adapters_are_openai_404s(lora_server) -> None:  # type: ignore[no-untyped-def]
    server, _ = lora_server
    bad_model = httpx.post(f"{server.url}{GEN}", json={"prompt": "x", "model": "nope"},
                           headers=AUTH)
    assert bad_model.status_code == 404
    assert bad_model.json()["error"]["code"] == "model_not_found"
    assert "'style'" in bad_model.json()["error"]["message"]  # lists what is served
    bad_lora = httpx.post(f"{server.url}{GEN}", headers=AUTH,
                          json={"prompt": "x", "loras": [{"name": "nope"}]})
    assert bad_lora.status_code == 404
    error = bad_lora.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (
        "loras", "adapter_not_found", "invalid_request_error")
    bad_scale = httpx.post(f"{server.url}{GEN}", headers=AUTH,
                           json={"prompt": "x", "loras": [{"name": "style", "scale": "1"}]})
    assert bad_scale.status_code == 400
    assert bad_scale.json()["error"]["param"] == "loras[0].scale"  # the entry's field, named


def test_load_use_and_unload_an_adapter(lora_server, metric=metric_value) -> None:  # type: ignore[no-untyped-def]
    server, files = lora_server
    load = {"lora_name": "extra", "lora_path": str(files["extra"])}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=load).status_code == 401
    loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json=load, headers=AUTH)
    assert loaded.status_code == 200 and "extra" in loaded.text
    again = httpx.post(f"{server.url}/v1/load_lora_adapter", json=load, headers=AUTH)
    assert again.status_code == 409 and "already loaded" in again.json()["error"]["message"]
    missing = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=AUTH,
                         json={"lora_name": "ghost", "lora_path": "/nonexistent.safetensors"})
    assert missing.status_code == 404 and "does not exist" in missing.json()["error"]["message"]
    assert missing.json()["error"]["code"] == "adapter_file_not_found"
    not_lora = tmp_text(files["extra"].parent / "notes.txt")
    bad = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=AUTH,
                     json={"lora_name": "notes", "lora_path": str(not_lora)})
    assert bad.status_code == 400 and "not a .safetensors file" in bad.text
    ids = [m["id"] for m in httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]]
    assert "extra" in ids

    body = {"prompt": "a red fox", "seed": 5, "num_inference_steps": 400, "size": "32x32",
            "loras": [{"name": "extra", "scale": 0.5}, {"name": "style"}], "stream": True}
    with httpx.stream("POST", f"{server.url}{GEN}", json=body, headers=AUTH,
                      timeout=300) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        seen = []
        for line in lines:
            seen.append(line)
            if "ditserve.progress" in line:
                break  # the request is running now, with its adapters
        busy = httpx.post(f"{server.url}/v1/unload_lora_adapter", headers=AUTH,
                          json={"lora_name": "extra"})
        events = parse_sse("\n".join([*seen, *lines]) + "\n")
    assert busy.status_code == 409, busy.text
    assert busy.json()["error"]["code"] == "adapter_in_use"
    assert events[-1][0] == "image_generation.completed"

    metrics = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    assert metric(metrics, "ditserve:lora_adapters_loaded") == 2
    assert metric(metrics, "ditserve:lora_resident_bytes") > 0
    done = httpx.post(f"{server.url}/v1/unload_lora_adapter", headers=AUTH,
                      json={"lora_name": "extra"})
    assert done.status_code == 200
    gone = httpx.post(f"{server.url}/v1/unload_lora_adapter", headers=AUTH,
                      json={"lora_name": "extra"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "adapter_not_found"
    after = httpx.post(f"{server.url}{GEN}", headers=AUTH,
                       json={"prompt": "x", "loras": [{"name": "extra"}]})
    assert after.status_code == 404


def test_a_file_for_another_model_is_refused_at_load(lora_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Issue 45: the load answered 200 and every request naming the adapter then got 500."""
    import torch
    from safetensors.torch import save_file

    server, _ = lora_server
    module = "transformer.transformer_blocks.0.attn.to_q"
    wrong = tmp_path / "wrong.safetensors"
    save_file({f"{module}.lora_A.weight": torch.randn(4, 7),
               f"{module}.lora_B.weight": torch.randn(5, 4)}, str(wrong))
    load = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=AUTH,
                      json={"lora_name": "wrong", "lora_path": str(wrong)})
    assert load.status_code == 400, load.text
    assert "trained for another model" in load.json()["error"]["message"]
    assert load.json()["error"]["param"] == "lora_path"  # the file is what is wrong
    ids = [m["id"] for m in httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]]
    assert "wrong" not in ids
    named = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=AUTH,
                       json={"lora_name": "bad name", "lora_path": str(wrong)})
    assert named.status_code == 400 and named.json()["error"]["param"] == "lora_name"


def test_max_loras_is_a_strict_bound(tmp_path: Path, metric=metric_value) -> None:  # type: ignore[no-untyped-def]
    from concurrent.futures import ThreadPoolExecutor

    from diffusers import FluxTransformer2DModel

    from ditserve.engine.makers.tiny_model import init_tiny

    model = init_tiny(tmp_path / "model", family="flux")
    dit = FluxTransformer2DModel.from_pretrained(model / "transformer")
    style = peft_lora(dit, tmp_path / "style.safetensors", rank=4, seed=1, std=0.6)
    extra = peft_lora(dit, tmp_path / "extra.safetensors", rank=8, seed=2, std=0.6)
    server = start_server(tmp_path, "--model", str(model), "--max-loras", "1",
                          "--lora-modules", f"style={style}", f"extra={extra}")
    try:
        started = server.log_text()
        assert "adapter style (rank 4" in started
        assert "1 LoRA adapters resident at start" in started and "--max-loras 1" in started
        stacked = httpx.post(f"{server.url}{GEN}", json={
            "prompt": "x", "loras": [{"name": "style"}, {"name": "extra"}]})
        assert stacked.status_code == 400, stacked.text
        error = stacked.json()["error"]
        assert error["param"] == "loras" and error["type"] == "invalid_request_error"
        assert "--max-loras" in error["message"]
        body = {"prompt": "a red fox", "seed": 5, "num_inference_steps": 3, "size": "32x32"}
        with ThreadPoolExecutor(3) as pool:  # at once: two adapters never share a step here
            together = list(pool.map(lambda m: image({**body, "model": m}, server),
                                     ["style", "extra", "style"]))
        alone = [image({**body, "model": m}, server) for m in ("style", "extra")]
        assert np.abs(together[0] - alone[0]).max() <= 1
        assert np.abs(together[2] - alone[0]).max() <= 1
        assert np.abs(together[1] - alone[1]).max() <= 1
        assert np.abs(alone[0] - alone[1]).max() > 4
        metrics = httpx.get(f"{server.url}/metrics").text
        assert metric(metrics, "ditserve:lora_adapters_loaded") == 2
        assert metric(metrics, "ditserve:lora_adapters_resident") == 1
        assert metric(metrics, "ditserve:lora_resident_bytes") > 0
    finally:
        server.stop()


@pytest.mark.parametrize("named", [(), ("--served-model-name", "fox")])
def test_an_adapter_named_as_the_served_model_is_refused_at_start(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        named: tuple[str, ...]) -> None:
    """``model`` selects an adapter by name, so one named as the model could never be used
    (and /v1/models listed two entries of one id); the runtime route already refuses it."""
    from ditserve.engine.cli.main import main

    served = named[1] if named else tiny_model_dir.name
    adapter = tmp_path / "style.safetensors"
    adapter.write_bytes(b"")
    assert main(["serve", "--model", str(tiny_model_dir), *named, "--port", "0",
                 "--lora-modules", f"{served}={adapter}"]) == 2
    assert f"{served!r} is the served model's name" in capsys.readouterr().err
