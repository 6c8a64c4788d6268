"""MiniMax-H3's omni-reference workflow over HTTP: a ref2va replica (`ditserve model ref2va`
of the tiny model, `ditserve serve` on it) taking ``references`` through the OpenAI SDK's
``extra_body`` (the ``references[]`` form fields it writes), as multipart file parts (an
image and a WAV soundtrack) and in a JSON body; what it refuses, each a 400 with OpenAI's
error object; and a text-to-video replica refusing references."""

from __future__ import annotations

import base64
import io
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from families.minimax_support import mp4  # type: ignore[import-not-found]
from openai.types import Video
from PIL import Image
from server.video_support import mp4_facts

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
FRAMES = 124  # MiniMax-H3's shortest clip: 5 s at 24 fps
BASE = {"prompt": "the cat looks up", "size": "64x32", "num_frames": str(FRAMES),
        "num_inference_steps": "2", "seed": "4"}


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def wav(seconds: float, rate: int = 8000) -> bytes:
    samples = (np.sin(np.arange(int(seconds * rate)) * 0.05) * 12000).astype("<i2")
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(samples.tobytes())
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def ref2va_server(tmp_path_factory: pytest.TempPathFactory, launch_server) -> Iterator[object]:  # type: ignore[no-untyped-def]
    from ditserve.engine.cli.main import main
    from ditserve.engine.makers.tiny_model import init_tiny

    tmp = tmp_path_factory.mktemp("ref2va-server")
    model = init_tiny(tmp / "model", family="minimax-h3")
    assert main(["model", "ref2va", str(model), str(tmp / "replica")]) == 0
    proc = launch_server(tmp, "--model", str(tmp / "replica"), "--max-num-seqs", "2",
                         "--max-side", "64", "--max-steps", "4")
    yield proc
    proc.stop()


def client_of(server: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused",  # type: ignore[attr-defined]
                         max_retries=0, timeout=120)


def wait_done(client: openai.OpenAI, video_id: str) -> Video:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        video = client.videos.retrieve(video_id)
        if video.status in ("completed", "failed"):
            return video
        time.sleep(0.2)
    raise AssertionError(f"video {video_id} did not finish")


def test_sdk_references_in_extra_body(ref2va_server) -> None:  # type: ignore[no-untyped-def]
    client = client_of(ref2va_server)
    job = client.videos.create(
        prompt="the cat looks up", size="64x32",  # type: ignore[arg-type]
        extra_body={"num_frames": FRAMES, "num_inference_steps": 2, "seed": 3,
                    "references": [data_url(png(40, 24, 1)), data_url(png(30, 50, 2))]})
    done = wait_done(client, job.id)
    assert done.status == "completed", done.error
    facts = mp4_facts(client.videos.download_content(done.id).read())
    assert (facts["frames"], facts["width"], facts["height"]) == (FRAMES, 64, 32)


def test_image_and_wav_file_parts(ref2va_server) -> None:  # type: ignore[no-untyped-def]
    files = [("references", ("cat.png", png(48, 48, 3), "image/png")),
             ("references", ("voice.wav", wav(1.0), "audio/wav"))]
    response = httpx.post(f"{ref2va_server.url}/v1/videos", timeout=60, files=files,
                          data={**BASE, "audio": "true"})
    assert response.status_code == 200, response.text
    done = wait_done(client_of(ref2va_server), response.json()["id"])
    assert done.status == "completed", done.error


def test_video_file_part_with_its_soundtrack(ref2va_server) -> None:  # type: ignore[no-untyped-def]
    files = [("references", ("dance.mp4", mp4(2.0, 30, 48, 32, 1, sound_rate=8000),
                             "video/mp4")),
             ("references", ("cat.png", png(32, 32, 2), "image/png"))]
    response = httpx.post(f"{ref2va_server.url}/v1/videos", timeout=60, files=files,
                          data={**BASE, "audio": "true"})
    assert response.status_code == 200, response.text
    done = wait_done(client_of(ref2va_server), response.json()["id"])
    assert done.status == "completed", done.error
    import av

    data = client_of(ref2va_server).videos.download_content(done.id).read()
    assert mp4_facts(data)["frames"] == FRAMES
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.audio[0].rate == 8000


def test_sdk_video_url_in_extra_body(ref2va_server) -> None:  # type: ignore[no-untyped-def]
    client = client_of(ref2va_server)
    job = client.videos.create(
        prompt="waves like these", size="64x32",  # type: ignore[arg-type]
        extra_body={"num_frames": FRAMES, "num_inference_steps": 1, "seed": 5,
                    "references": [{"video_url": data_url(mp4(1.0, 24, 32, 48, 3),
                                                          "video/mp4")}]})
    done = wait_done(client, job.id)
    assert done.status == "completed", done.error


def test_references_in_a_json_body(ref2va_server) -> None:  # type: ignore[no-untyped-def]
    response = httpx.post(f"{ref2va_server.url}/v1/videos", timeout=60, json={
        "prompt": "waves", "size": "64x32", "num_frames": FRAMES, "num_inference_steps": 1,
        "references": [{"image_url": data_url(png(64, 32, 4))},
                       {"audio_url": data_url(wav(0.5), "audio/wav")}]})
    assert response.status_code == 200, response.text
    assert wait_done(client_of(ref2va_server), response.json()["id"]).status == "completed"


def refused(server: object, **body: object) -> dict[str, str]:
    response = httpx.post(f"{server.url}/v1/videos", timeout=60,  # type: ignore[attr-defined]
                          json={"prompt": "x", "size": "64x32", "num_frames": FRAMES,
                                "num_inference_steps": 1, **body})
    assert response.status_code == 400, response.text
    error: dict[str, str] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def test_what_a_ref2va_replica_refuses(ref2va_server) -> None:  # type: ignore[no-untyped-def]
    image = data_url(png(32, 32, 5))
    error = refused(ref2va_server)  # text only: diffusers' ref2va needs a reference too
    assert error["param"] == "references" and "at least one image or video reference" in error["message"]
    error = refused(ref2va_server, references=[image] * 10)
    assert "at most 9 image references" in error["message"]
    error = refused(ref2va_server, references=[data_url(b"not an image")])
    assert error["code"] == "invalid_reference" and "references[0]" in error["message"]
    broken = b"\0\0\0\x18ftypmp42" + b"\0" * 32
    error = refused(ref2va_server, references=[image, data_url(broken, "video/mp4")])
    assert "references[1]" in error["message"] and "not a readable video" in error["message"]
    loud = data_url(mp4(1.0, 24, 32, 32, 4, sound_rate=16000), "video/mp4")
    error = refused(ref2va_server, references=[{"video_url": loud}])
    assert "16000 Hz" in error["message"] and "ffmpeg -ar 8000" in error["message"]
    error = refused(ref2va_server, references=[image, data_url(wav(0.5, 16000), "audio/wav")])
    assert "8000 Hz" in error["message"] and "torchaudio" in error["message"]
    error = refused(ref2va_server, references=["https://example.com/cat.png"])
    assert "fetches no URLs" in error["message"]
    error = refused(ref2va_server, references=[image], input_reference={"image_url": image})
    assert error["param"] == "input_reference"


def test_the_openapi_document_describes_references(ref2va_server) -> None:  # type: ignore[no-untyped-def]
    document = httpx.get(f"{ref2va_server.url}/openapi.json", timeout=30).json()
    schemas = document["components"]["schemas"]
    field = schemas["VideoCreateRequest"]["properties"]["references"]
    assert "9" in str(field) and "8000 Hz" in str(field)
    assert schemas["VideoCreateForm"]["properties"]["references"]["type"] == "array"


def test_a_text_to_video_replica_refuses_references(tmp_path: Path) -> None:
    import asyncio

    from server.video_support import fake_video_engine, video_app  # type: ignore[import-not-found]

    engine = fake_video_engine(tmp_path)
    app, _ = video_app(engine)

    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.post("/v1/videos", json={
                "prompt": "waves", "references": [data_url(png(16, 16, 6))]})

    try:
        response = asyncio.run(run())
    finally:
        app.state.server.videos.close()
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "references" and "ref2va replica" in error["message"]
    assert engine.submitted == []
