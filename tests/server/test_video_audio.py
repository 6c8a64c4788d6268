"""A video job with a sound track on the real engine and the tiny Cosmos3 model: the job's MP4
holds the frames and an AAC stream at the model's sample rate; the OpenAPI document offers
``audio`` because this model makes sound."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
from server.video_support import finish, run

from ditserve.engine.config import EngineConfig
from ditserve.engine.loop.engine import DiffusionEngine
from ditserve.engine.server.app import create_app
from ditserve.engine.server.config import ServerConfig


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from ditserve.engine.makers.tiny_model import init_tiny

    model = init_tiny(tmp_path_factory.mktemp("tiny-cosmos3") / "model", family="cosmos3")
    engine = DiffusionEngine(EngineConfig(model=str(model), device="cpu")).start()
    server = ServerConfig(video_dir=str(tmp_path_factory.mktemp("videos")))
    app = create_app(engine, server, start_engine=False)
    yield app
    app.state.server.stop()


def test_a_job_with_audio_has_an_aac_track(served: Any) -> None:
    import av

    async def script(client: Any) -> Any:
        created = await client.post("/v1/videos", json={
            "prompt": "rain on a roof", "size": "64x64", "num_frames": 9,
            "num_inference_steps": 2, "seed": 3, "audio": True})
        assert created.status_code == 200, created.text
        job = created.json()
        events = await finish(client, job["id"])
        return events, await client.get(f"/v1/videos/{job['id']}/content")

    events, content = run(served, script, close=False)
    assert events[-1][0] == "video.completed", events[-1]
    with av.open(io.BytesIO(content.content)) as container:
        assert container.streams.video[0].frames == 9
        sound = container.streams.audio[0]
        assert (sound.codec_context.name, sound.rate) == ("aac", 8000)
        samples = sum(f.samples for f in container.decode(sound))
    # 9 frames at 24 fps are 3000 samples at 8 kHz; AAC pads to whole 1024-sample frames.
    assert 3000 <= samples <= 3000 + 2048


def test_openapi_offers_audio(served: Any) -> None:
    async def script(client: Any) -> Any:
        return await client.get("/openapi.json")

    text = json.dumps(run(served, script, close=False).json())
    # Any boolean: a model without sound restricts it to false ("enum": [false]).
    assert '"audio": {"anyOf": [{"type": "boolean", "description"' in text


def test_a_sound_track_keeps_the_models_frame_rate(served: Any) -> None:
    # The sound is made for the frames at the model's 24 fps: at 8 fps the MP4's picture
    # lasted three times its sound.
    async def script(client: Any) -> Any:
        return await client.post("/v1/videos", json={
            "prompt": "rain", "size": "64x64", "num_frames": 9, "fps": 8,
            "num_inference_steps": 1, "audio": True})

    response = run(served, script, close=False)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "fps" and "24 fps" in error["message"]
