"""An HTTP request that leaves guidance, CFG and text length out gets the model pipeline's own
defaults, as a default diffusers call does: real engines on the `init-tiny` models, requests
through the app (images) or its request parser (video jobs, whose MP4 is lossy)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from ditserve.engine.cli.generate import generation_params
from ditserve.engine.cli.main import build_parser
from ditserve.engine.config import EngineConfig
from ditserve.engine.loop.engine import DiffusionEngine
from ditserve.engine.server.app import create_app
from ditserve.engine.server.config import ServerConfig
from ditserve.engine.server.generation.request import parse_generation_request
from ditserve.engine.server.model_defaults import model_defaults
from ditserve.engine.server.state import ServerState
from ditserve.engine.server.videos.request import parse_video_request

GEN = "/v1/images/generations"


@pytest.fixture(scope="module")
def engine_of(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Any]]:
    """engine_of(variant) -> a started CPU DiffusionEngine on that tiny model (shared)."""
    from ditserve.engine.makers.tiny_model import init_tiny

    root = tmp_path_factory.mktemp("models")
    engines: dict[str, Any] = {}

    def get(variant: str) -> Any:
        if variant not in engines:
            model = init_tiny(root / variant, family=variant)
            engines[variant] = DiffusionEngine(
                EngineConfig(model=str(model), device="cpu")).start()
        return engines[variant]

    yield get
    for engine in engines.values():
        engine.shutdown()


def _post(engine: Any, body: dict[str, Any]) -> httpx.Response:
    app = create_app(engine, ServerConfig(), start_engine=False)

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(GEN, json=body, timeout=300)

    return asyncio.run(run())


def test_qwen_image_empty_negative_prompt_runs_true_cfg_as_diffusers(engine_of) -> None:  # type: ignore[no-untyped-def]
    import diffusers

    engine = engine_of("qwen-image")
    body = {"prompt": "a red cat", "negative_prompt": "", "size": "64x32",
            "num_inference_steps": 3, "seed": 5}
    response = _post(engine, body)
    assert response.status_code == 200, response.text
    png = base64.b64decode(response.json()["data"][0]["b64_json"])
    got = torch.from_numpy(np.array(Image.open(io.BytesIO(png)).convert("RGB")))
    pipe = diffusers.QwenImagePipeline.from_pretrained(Path(engine.config.model))
    pipe.set_progress_bar_config(disable=True)

    def png_levels(**call: Any) -> torch.Tensor:
        images = pipe("a red cat", width=64, height=32, num_inference_steps=3, **call,
                      generator=torch.Generator("cpu").manual_seed(5), output_type="pt").images
        return (images[0].permute(1, 2, 0) * 255).round().to(torch.uint8)  # as the PNG

    # A default call: true_cfg_scale (4.0), max_sequence_length and guidance are the pipeline's.
    expected = png_levels(negative_prompt="")
    without_cfg = png_levels(negative_prompt=None)
    assert got.shape == expected.shape
    assert (got.int() - expected.int()).abs().max().item() <= 1  # float noise may round apart
    same = (got == expected).float().mean().item()
    # The tiny model's CFG moves pixels little, so count exact 8-bit levels: the answer is the
    # CFG image, and the unguided one (what a refused or ignored empty prompt gives) is not.
    assert same >= 0.98
    assert (without_cfg == expected).float().mean().item() < 0.98


CASES = {  # the request fields; `ditserve generate` gets the same values as flags
    "flux": {"prompt": "a fox", "size": "32x32", "num_inference_steps": 2, "seed": 3},
    "qwen-image": {"prompt": "a cat", "size": "32x32", "num_inference_steps": 2, "seed": 3},
    "wan": {"prompt": "waves", "size": "32x32", "num_frames": 5, "num_inference_steps": 2,
            "seed": 3},
    "wan2.2": {"prompt": "waves", "negative_prompt": "", "size": "32x32", "num_frames": 5,
               "num_inference_steps": 2, "seed": 3},
}


@pytest.mark.parametrize("variant", sorted(CASES))
def test_http_defaults_are_generates_which_equal_diffusers(engine_of, variant: str) -> None:  # type: ignore[no-untyped-def]
    # tests/families/test_default_call.py shows `ditserve generate`'s defaults reproduce a
    # default diffusers call; the API must run exactly the same request.
    engine = engine_of(variant)
    fields = CASES[variant]
    state = ServerState.build(engine, ServerConfig())
    if model_defaults(engine.config.model).output == "video":
        http = parse_video_request(dict(fields), engine=engine,
                                   limits=state.video_limits()).params
    else:
        http = parse_generation_request(json.dumps(fields).encode(), engine=engine,
                                        limits=state.limits()).params
    width, height = fields["size"].split("x")
    flags = ["generate", "--model", engine.config.model, "--prompt", fields["prompt"],
             "--width", width, "--height", height,
             "--steps", str(fields["num_inference_steps"]), "--seed", str(fields["seed"])]
    if "num_frames" in fields:
        flags += ["--num-frames", str(fields["num_frames"])]
    if "negative_prompt" in fields:
        flags += ["--negative-prompt", fields["negative_prompt"]]
    cli = generation_params(build_parser().parse_args(flags), model_defaults(engine.config.model))
    assert http == cli


@pytest.mark.parametrize("family", ["cosmos3", "minimax-h3"])
def test_tiny_video_models_default_to_a_small_clip_at_their_own_rate(
        family: str, tmp_path: Path) -> None:
    # Cosmos3's DiT config gives its width as hidden_size: its tiny model was taken for a
    # full one (1280x720, 189 frames, 35 steps: minutes on a CPU). MiniMax-H3's tiny model
    # played at 16 fps the 24 fps clip its sound track is made for.
    from ditserve.engine.makers.tiny_model import init_tiny

    defaults = model_defaults(init_tiny(tmp_path / "model", family=family))
    assert (defaults.width, defaults.height, defaults.steps) == (64, 64, 4)
    assert defaults.fps == 24


@pytest.mark.parametrize(("family", "fps"), [("wan", 16), ("wan2.2-ti2v", 24),
                                             ("wan2.2-ti2v-i2v", 24), ("wan-i2v", 16)])
def test_wan_videos_default_to_their_models_frame_rate(family: str, fps: int,
                                                       tmp_path: Path) -> None:
    # Wan 2.2 TI2V-5B (the model with Wan 2.2's residual VAE) generates 24 fps; it was
    # written at Wan 2.1's 16, so its clips played 1.5x slow and `seconds` counted too few.
    from ditserve.engine.makers.tiny_model import init_tiny

    defaults = model_defaults(init_tiny(tmp_path / "model", family=family))
    assert defaults.output == "video" and defaults.fps == fps
