"""Shared by the video API tests: a fake video model directory, an app around a fake engine,
SSE waiting and MP4 probing."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import sys
from pathlib import Path
from typing import Any

import httpx
from openai.types import Video

from ditserve.engine.config import EngineConfig
from ditserve.engine.server.app import create_app
from ditserve.engine.server.config import ServerConfig
from ditserve.engine.server.metrics import ServingMetrics
from ditserve.engine.server.streaming import parse_sse

_spec = importlib.util.spec_from_file_location("server_fake_engine",
                                               Path(__file__).with_name("fake_engine.py"))
assert _spec and _spec.loader
fake_engine = sys.modules.get(_spec.name) or importlib.util.module_from_spec(_spec)
if _spec.name not in sys.modules:
    sys.modules[_spec.name] = fake_engine  # dataclasses look the module up while decorating
    _spec.loader.exec_module(fake_engine)
FakeEngine = fake_engine.FakeEngine

FINAL = ("video.completed", "video.failed")


class AnySizeVideo(Video):
    """The SDK's ``Video`` with ``size`` widened to any string: its ``VideoSize`` Literal
    lists only Sora's four sizes, while a replica makes every size its model allows (a job
    of one of those four sizes validates against ``Video`` itself:
    test_video_api.py). Every other field is validated as the SDK declares it."""

    size: str  # type: ignore[assignment]


def wan_layout(path: Path) -> Path:
    """A directory that reads as a test-sized Wan model (what model_defaults looks at)."""
    (path / "transformer").mkdir(parents=True, exist_ok=True)
    (path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    (path / "transformer" / "config.json").write_text(
        json.dumps({"num_attention_heads": 2, "attention_head_dim": 12}))
    return path


def fake_video_engine(tmp: Path, **kwargs: Any) -> Any:
    """A FakeEngine that is a video model (frame step 4, pixel multiple 4)."""
    return FakeEngine(config=EngineConfig(model=str(wan_layout(tmp / "wan"))), frame_step=4,
                      **kwargs)


def video_app(engine: Any, config: ServerConfig | None = None) -> tuple[Any, ServingMetrics]:
    metrics = ServingMetrics(lambda: engine)
    engine.observers.append(metrics)
    app = create_app(engine, config or ServerConfig(), start_engine=False,
                     serving_metrics=metrics)
    return app, metrics


def run(app: Any, script: Any, *, close: bool = True) -> Any:
    """Run ``await script(client)`` against ``app`` (httpx's ASGI transport), then (with
    ``close``) stop the app's job layer as the server's shutdown does."""
    async def go() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await script(client)

    try:
        return asyncio.run(go())
    finally:
        videos = app.state.server.videos
        if close and videos is not None:
            videos.close()


async def finish(client: httpx.AsyncClient, video_id: str) -> list[tuple[str, dict[str, Any]]]:
    """The job's events until its final one (ASGI transport: the whole stream at once)."""
    response = await client.get(f"/v1/videos/{video_id}/events")
    assert response.status_code == 200, response.text
    events = parse_sse(response.text)
    assert events[-1][0] in FINAL, events
    return events


def mp4_facts(data: bytes) -> dict[str, Any]:
    """Decode an MP4 with PyAV: frame count, size, frame rate, codec."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = list(container.decode(stream))
        return {"frames": len(frames), "width": stream.codec_context.width,
                "height": stream.codec_context.height, "fps": float(stream.average_rate),
                "codec": stream.codec_context.name,
                "first_frame": frames[0].to_ndarray(format="rgb24") if frames else None}
