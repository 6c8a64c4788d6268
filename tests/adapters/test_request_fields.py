"""The request fields that select adapters, for images and video jobs alike (JSON and the
form a video SDK sends), and `ditserve generate --lora` end to end."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from ditserve.engine.adapters.catalog import AdapterCatalog
from ditserve.engine.config.adapters import AdapterConfig
from ditserve.engine.server.errors import APIError
from ditserve.engine.server.generation.request import parse_generation_request
from ditserve.engine.server.limits import RequestLimits, VideoLimits
from ditserve.engine.server.videos.request import parse_video_request

CATALOG = AdapterCatalog(AdapterConfig(lora_modules={"style": "/s.safetensors",
                                                     "detail": "/d.safetensors"}),
                         inspect=lambda path: 16)
ENGINE = SimpleNamespace(adapters=CATALOG, validate_params=lambda p: p.validate(
    pixel_multiple=16, frame_step=4 if p.num_frames > 1 else None))
VIDEO = VideoLimits(model_name="wan", default_size=(64, 64), default_steps=4,
                    default_frames=5, default_fps=16, default_guidance=5.0, pixel_multiple=16,
                    frame_step=4, max_prompt_chars=None, max_side=256, max_steps=50,
                    max_frames=81)
IMAGE = RequestLimits(model_name="flux", default_size=(64, 64), default_steps=4,
                      pixel_multiple=16, max_prompt_chars=None)


def image(body: dict) -> tuple:  # type: ignore[type-arg]
    parsed = parse_generation_request(json.dumps(body).encode(), engine=ENGINE, limits=IMAGE)
    return tuple((r.name, r.scale, r.rank) for r in parsed.params.loras)


def test_image_selection() -> None:
    assert image({"prompt": "x"}) == ()
    assert image({"prompt": "x", "model": "flux"}) == ()
    assert image({"prompt": "x", "model": "style"}) == (("style", 1.0, 16),)
    assert image({"prompt": "x", "model": "style",
                  "loras": [{"name": "detail", "scale": 0.4}]}) == (
        ("style", 1.0, 16), ("detail", 0.4, 16))
    with pytest.raises(APIError) as info:
        image({"prompt": "x", "loras": [{"name": "detail", "weight": 1}]})
    assert info.value.status == 400 and info.value.param == "loras[0].weight"
    with pytest.raises(APIError) as info:
        image({"prompt": "x", "loras": [{"name": "style", "scale": 50}]})
    assert info.value.status == 400 and "scale must be a number" in info.value.message


def test_video_jobs_accept_the_same_fields() -> None:
    spec = parse_video_request({"prompt": "x", "model": "detail",
                                "loras": [{"name": "style", "scale": 0.5}]},
                               engine=ENGINE, limits=VIDEO)
    assert [(r.name, r.scale) for r in spec.params.loras] == [("detail", 1.0), ("style", 0.5)]
    with pytest.raises(APIError) as info:
        parse_video_request({"prompt": "x", "loras": [{"name": "nope"}]}, engine=ENGINE,
                            limits=VIDEO)
    assert (info.value.status, info.value.code) == (404, "adapter_not_found")


def test_a_form_carries_loras_as_names_or_json_text() -> None:
    # One reader for the edits route's and the video jobs' forms.
    from ditserve.engine.server.fields.extensions import form_value as _form_value

    assert _form_value("loras", '[{"name": "style"}]') == [{"name": "style"}]
    assert _form_value("loras", "style") == [{"name": "style", "scale": None}]
    assert _form_value("loras", "style:0.8,char") == [{"name": "style", "scale": 0.8},
                                                      {"name": "char", "scale": None}]
    for bad in ("", "y\u00b6", "style:high", "[not json"):
        with pytest.raises(APIError, match="name\\[:scale\\]"):
            _form_value("loras", bad)


def test_generate_cli_applies_a_lora(adapter_models, lora_files, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.cli.main import main

    model, files = adapter_models("flux"), lora_files("flux")
    common = ["generate", "--model", str(model), "--device", "cpu", "--prompt", "a red cat",
              "--steps", "3", "--seed", "7", "--height", "32", "--width", "32"]
    assert main([*common, "--out", str(tmp_path / "base.png")]) == 0
    assert main([*common, "--out", str(tmp_path / "lora.png"),
                 "--lora", f"a={files['a']}:1.0", "--lora", f"b={files['b']}:0.5"]) == 0
    base = np.asarray(Image.open(tmp_path / "base.png")).astype(int)
    lora = np.asarray(Image.open(tmp_path / "lora.png")).astype(int)
    assert base.shape == lora.shape and np.abs(base - lora).max() > 4


def test_runtime_updates_are_opt_in() -> None:
    from ditserve.engine.server.adapters.routes import RUNTIME_UPDATES_ENV, runtime_updates_allowed

    assert not runtime_updates_allowed({})
    assert not runtime_updates_allowed({RUNTIME_UPDATES_ENV: "0"})
    assert runtime_updates_allowed({RUNTIME_UPDATES_ENV: "true"})
