"""The video replica as a real process (`ditserve serve` on the tiny Wan model), driven by the
official OpenAI SDK (openai 3.57 has ``client.videos``: create, retrieve, download_content,
delete, list) and by httpx for what the SDK does not do (the SSE events, Range, HEAD): the
job lifecycle as a client sees it, Range requests on the real MP4, cancel and delete over
HTTP, what a restart leaves, and the SDK's error classes."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server.video_support import FINAL, AnySizeVideo, mp4_facts

from ditserve.engine.server.streaming import parse_sse

# The SDK marks the videos resource deprecated (OpenAI's own service); the API is the same.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def client(video_server) -> openai.OpenAI:
    """An SDK client on an idle replica: jobs other tests left (the schemathesis run) are
    cancelled first, so these tests see only their own."""
    sdk = openai.OpenAI(base_url=f"{video_server.url}/v1", api_key="unused", max_retries=0,
                        timeout=60)
    for video in sdk.videos.list(limit=100):
        if video.status in ("queued", "in_progress"):
            sdk.videos.delete(video.id)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # another process: poll its /ready counts
        ready = httpx.get(f"{video_server.url}/ready").json()
        if ready["running"] + ready["waiting"] == 0:
            break
        time.sleep(0.05)
    return sdk


def events_until_final(url: str, video_id: str) -> list[tuple[str, dict[str, Any]]]:
    """Follow the job's SSE stream until its final event (no polling)."""
    with httpx.stream("GET", f"{url}/v1/videos/{video_id}/events", timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = "".join(response.iter_text())
    events = parse_sse(body)
    assert events[-1][0] in FINAL, events
    return events


def test_lifecycle_with_the_sdk(client, video_server) -> None:
    busy = [client.videos.create(prompt=f"blocker {i}", size="32x32",
                                 extra_body={"num_inference_steps": 8}) for i in range(2)]
    video = client.videos.create(prompt="a red fox in snow", seconds="1", size="64x32",
                                 extra_body={"num_inference_steps": 6, "seed": 5})
    assert (video.object, video.status, video.progress) == ("video", "queued", 0)
    assert (video.size, video.seconds, video.model) == ("64x32", "1.0625", "model")
    events = events_until_final(video_server.url, video.id)
    statuses = [data["video"]["status"] for _, data in events]
    progress = [data["video"]["progress"] for _, data in events]
    # Queued behind the two blockers when it was made; by the time the stream is followed it
    # may have begun (the blockers are milliseconds of work): no timing is asserted.
    assert statuses[0] in ("queued", "in_progress") and statuses[-1] == "completed"
    assert statuses.count("in_progress") >= 1
    assert progress == sorted(progress) and progress[-1] == 100
    assert all(kind == f"video.{data['video']['status']}" for kind, data in events)
    # Every object the API returns validates against the SDK's own model (strict).
    raw = [data["video"] for _, data in events] + [
        httpx.get(f"{video_server.url}/v1/videos/{video.id}").json(),
        *httpx.get(f"{video_server.url}/v1/videos").json()["data"]]
    for obj in raw:
        AnySizeVideo.model_validate(obj, strict=True)
    done = client.videos.retrieve(video.id)
    assert (done.status, done.progress) == ("completed", 100)
    assert done.completed_at is not None and done.expires_at == done.completed_at + 3600
    data = client.videos.download_content(video.id).read()
    facts = mp4_facts(data)
    assert (facts["frames"], facts["width"], facts["height"], facts["fps"]) == (17, 64, 32, 16.0)
    for job in busy:
        events_until_final(video_server.url, job.id)


def test_range_requests_on_the_real_mp4(client, video_server) -> None:
    video = client.videos.create(prompt="waves", size="32x32",
                                 extra_body={"num_frames": 9, "num_inference_steps": 2})
    events_until_final(video_server.url, video.id)
    url = f"{video_server.url}/v1/videos/{video.id}/content"
    full = httpx.get(url).content
    size = len(full)
    part = httpx.get(url, headers={"Range": "bytes=4-11"})
    assert (part.status_code, part.content) == (206, full[4:12])  # the 'ftyp' box
    assert part.headers["content-range"] == f"bytes 4-11/{size}"
    tail = httpx.get(url, headers={"Range": f"bytes={size - 10}-"})
    assert tail.content == full[-10:]
    head = httpx.head(url)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == str(size)
    past = httpx.get(url, headers={"Range": f"bytes={size}-"})
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{size}"
    assert set(past.json()["error"]) == {"message", "type", "param", "code"}
    # The 416 is the document's own: declared on the route, with its header and body.
    doc = httpx.get(f"{video_server.url}/openapi.json").json()
    declared = doc["paths"]["/v1/videos/{video_id}/content"]["get"]["responses"]["416"]
    pattern = declared["headers"]["Content-Range"]["schema"]["pattern"]
    assert re.fullmatch(pattern, past.headers["content-range"])
    body_schema = {**declared["content"]["application/json"]["schema"],
                   "components": doc["components"]}
    jsonschema.validate(past.json(), body_schema)


def test_delete_cancels_a_queued_job_and_removes_a_finished_one(client, video_server,
                                                                video_dir) -> None:
    busy = [client.videos.create(prompt=f"busy {i}", size="32x32",
                                 extra_body={"num_inference_steps": 8}) for i in range(2)]
    queued = client.videos.create(prompt="never made", size="32x32")
    url = f"{video_server.url}/v1/videos/{queued.id}/events"
    with httpx.stream("GET", url, timeout=120) as following:  # subscribed once headers came
        deleted = client.videos.delete(queued.id)
        events = parse_sse("".join(following.iter_text()))
    assert (deleted.id, deleted.deleted, deleted.object) == (queued.id, True, "video.deleted")
    # Its followers see it end as OpenAI spells a cancelled job; then it is gone.
    final = AnySizeVideo.model_validate(events[-1][1]["video"], strict=True)
    assert (events[-1][0], final.status, final.error.code) == ("video.failed", "failed",
                                                               "cancelled")
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(queued.id)
    assert queued.id not in [v.id for v in client.videos.list(limit=100)]
    for job in busy:
        events_until_final(video_server.url, job.id)
    path = video_dir / f"{busy[0].id}.mp4"
    assert path.is_file()
    client.videos.delete(busy[0].id)
    assert not path.exists()
    with pytest.raises(openai.NotFoundError) as gone:
        client.videos.retrieve(busy[0].id)
    assert gone.value.body["code"] == "video_not_found"


def test_list_pages_through_the_sdk(client, video_server) -> None:
    made = [client.videos.create(prompt=f"list {i}", size="16x16",
                                 extra_body={"num_frames": 1, "num_inference_steps": 1})
            for i in range(3)]
    page = client.videos.list(limit=2)
    assert len(page.data) == 2 and page.has_more
    newest_first = [v.id for v in client.videos.list(limit=2)]  # the SDK follows the pages
    assert newest_first[:3] == [v.id for v in reversed(made)]
    assert newest_first == sorted(newest_first, reverse=True)
    for video in made:
        events_until_final(video_server.url, video.id)


def test_what_a_restart_leaves(client, video_server, video_dir, leftover_id) -> None:
    """Job state lives in memory: a job of a previous server on the same --video-dir is
    unknown (404), and that server's files are gone; nothing else in the directory is."""
    response = httpx.get(f"{video_server.url}/v1/videos/{leftover_id}")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "video_not_found"
    assert not (video_dir / f"{leftover_id}.mp4").exists()
    assert list((video_dir / ".tmp").glob(f"{leftover_id}*")) == []
    assert (video_dir / "notes.txt").is_file()


def test_sdk_errors_and_the_image_route(client) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.videos.create(prompt="x", size="1280x720")  # over --max-side 64
    assert bad.value.body["param"] == "size"
    with pytest.raises(openai.NotFoundError):
        client.videos.create(prompt="x", model="sora-2")
    with pytest.raises(openai.BadRequestError) as image:
        client.images.generate(prompt="a cat")
    assert image.value.body["code"] == "unsupported_model"


def test_metrics_count_jobs_and_seconds(client, video_server, metric) -> None:
    text = httpx.get(f"{video_server.url}/metrics").text
    assert metric(text, 'ditserve:video_jobs_finished_total{status="completed"}') >= 1
    assert metric(text, "ditserve:video_seconds_generated_total") > 0
    assert metric(text, 'ditserve:video_jobs{status="completed"}') >= 1
    assert metric(text, "ditserve:step_batch_size_count") > 0
    ready = httpx.get(f"{video_server.url}/ready").json()
    assert json.dumps(sorted(ready)) == json.dumps(sorted(
        ["ready", "phase", "model", "compile", "device", "dtype", "max_num_seqs", "max_queue",
         "running", "waiting", "step_in_flight", "max_request_tokens", "pixel_multiple",
         "offload", "pipeline"]))  # /ready: the same keys, and the pipeline plan (encoders, VAE, cache)
