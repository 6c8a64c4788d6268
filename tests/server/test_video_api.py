"""/v1/videos in-process (httpx ASGI transport) around a fake video engine: validation (400
with OpenAI's error object), unknown ids (404), one model per replica, the OpenAPI document,
admission (429 from the store's bounds; a job waits for the engine's room), multipart bodies, the MP4
content (Range, If-Range, HEAD, 416), failures of the engine, and the job metrics."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import pytest
from openai.types import Video
from server.video_support import FakeEngine, fake_video_engine, finish, mp4_facts, run, video_app

from ditserve.engine.server.config import ServerConfig

VIDEOS = "/v1/videos"
JOB = {"prompt": "waves at night", "size": "32x16", "num_frames": 5, "fps": 8,
       "num_inference_steps": 3, "seed": 7}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({}, "prompt", "is required"),
    ({"prompt": "  "}, "prompt", "must not be empty"),
    ({"prompt": "x", "num_frames": 6}, "num_frames", "4k+1"),
    ({"prompt": "x", "num_frames": "5"}, "num_frames", "must be an integer"),
    ({"prompt": "x", "size": "30x16"}, "size", "multiple of 4"),
    ({"prompt": "x", "size": "big"}, "size", "WIDTHxHEIGHT"),
    ({"prompt": "x", "seconds": 0}, "seconds", "must be > 0"),
    ({"prompt": "x", "seconds": "1.5"}, "seconds", "whole seconds"),
    ({"prompt": "x", "seconds": True}, "seconds", "a number or a whole-second string"),
    ({"prompt": "x", "seconds": 1, "num_frames": 5}, "num_frames", "give seconds alone"),
    ({"prompt": "x", "seconds": 1, "fps": 24}, "fps", "give seconds alone"),
    ({"prompt": "x", "fps": 0}, "fps", "[1, 120]"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps", "[1, 1000]"),
    ({"prompt": "x", "guidance_scale": 101}, "guidance_scale", "[0, 100]"),
    ({"prompt": "x", "seed": -1}, "seed", "[0, 2^63)"),
    ({"prompt": "x", "colour": "red"}, "colour", "unknown field"),
    ({"prompt": "x", "input_reference": "frame.png"}, "input_reference", "text only"),
    ({"prompt": "x", "last_frame_reference": {"image_url": "data:image/png;base64,AA=="}},
     "last_frame_reference", "text only"),  # the field sent is the one named
    ({"prompt": "x", "audio": True}, "audio", "no sound track"),  # Wan makes none
    ({"prompt": "x", "audio": "yes"}, "audio", "true or false"),
])
def test_bad_inputs_are_400_with_the_error_object(tmp_path: Path, body, param, words) -> None:
    app, _ = video_app(fake_video_engine(tmp_path))

    async def script(client):
        return await client.post(VIDEOS, json=body)

    response = run(app, script)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert words in error["message"]


def test_unknown_ids_are_404_in_openai_shape(tmp_path: Path) -> None:
    app, _ = video_app(fake_video_engine(tmp_path))
    unknown = "video_" + "f" * 32

    async def script(client):
        return [await client.request(method, VIDEOS + path)
                for method, path in (("GET", f"/{unknown}"), ("GET", f"/{unknown}/content"),
                                     ("GET", f"/{unknown}/events"), ("DELETE", f"/{unknown}"),
                                     ("GET", "/not-an-id"))]

    for response in run(app, script):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "video_not_found"
        assert response.json()["error"]["param"] == "video_id"


def test_one_model_per_replica(tmp_path: Path) -> None:
    image_app, _ = video_app(FakeEngine())
    video_app_, _ = video_app(fake_video_engine(tmp_path))

    async def on_image(client):
        return (await client.post(VIDEOS, json=JOB), await client.get(VIDEOS),
                (await client.get("/openapi.json")).json())

    async def on_video(client):
        return (await client.post("/v1/images/generations", json={"prompt": "cat"}),
                (await client.get("/openapi.json")).json())

    refused, listed, image_doc = run(image_app, on_image)
    assert refused.status_code == listed.status_code == 400
    assert refused.json()["error"]["code"] == "unsupported_model"
    assert "POST /v1/images/generations" in refused.json()["error"]["message"]
    refused_image, video_doc = run(video_app_, on_video)
    assert refused_image.status_code == 400
    assert "POST /v1/videos" in refused_image.json()["error"]["message"]
    # Each document describes what its replica serves, and only that.
    assert "/v1/images/generations" in image_doc["paths"]
    assert not [p for p in image_doc["paths"] if p.startswith(VIDEOS)]
    assert "/v1/images/generations" not in video_doc["paths"]
    assert {VIDEOS, VIDEOS + "/{video_id}", VIDEOS + "/{video_id}/content",
            VIDEOS + "/{video_id}/events"} <= set(video_doc["paths"])


def test_openapi_describes_bodies_media_types_and_errors(tmp_path: Path) -> None:
    app, _ = video_app(fake_video_engine(tmp_path), ServerConfig(max_frames=17, max_side=64))

    async def script(client):
        return (await client.get("/openapi.json")).json()

    doc = run(app, script)
    create = doc["paths"][VIDEOS]["post"]
    assert set(create["requestBody"]["content"]) == {"application/json", "multipart/form-data"}
    assert {"200", "400", "404", "413", "429", "500", "503"} <= set(create["responses"])
    schemas = doc["components"]["schemas"]
    body = schemas["VideoCreateRequest"]["properties"]
    assert body["num_frames"]["anyOf"][0]["enum"] == [1, 5, 9, 13, 17]
    assert schemas["VideoCreateForm"]["properties"]["seconds"]["enum"] == ["1"]
    content = doc["paths"][VIDEOS + "/{video_id}/content"]["get"]["responses"]
    assert set(content["200"]["content"]) == set(content["206"]["content"]) == {"video/mp4"}
    assert "Content-Range" in content["206"]["headers"]
    assert "Content-Range" in content["416"]["headers"]
    for status in ("404", "409", "416"):
        assert content[status]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/Error"}
    events = doc["paths"][VIDEOS + "/{video_id}/events"]["get"]["responses"]["200"]
    assert set(events["content"]) == {"text/event-stream"}
    assert "video.completed" in events["content"]["text/event-stream"]["schema"][
        "properties"]["event"]["enum"]
    assert set(doc["paths"][VIDEOS + "/{video_id}"]) == {"get", "delete"}


def test_a_job_from_json_and_the_same_from_a_form(tmp_path: Path) -> None:
    app, metrics = video_app(fake_video_engine(tmp_path))
    form = {k: (None, str(v)) for k, v in JOB.items()}  # multipart text fields

    async def script(client):
        made = [await client.post(VIDEOS, json=JOB),
                await client.post(VIDEOS, files=form)]
        finished = [await finish(client, r.json()["id"]) for r in made]
        contents = [(await client.get(f"{VIDEOS}/{r.json()['id']}/content")).content
                    for r in made]
        return made, finished, contents, (await client.get("/metrics")).text

    made, finished, contents, text = run(app, script)
    for response in made:
        job = response.json()
        assert response.status_code == 200
        assert (job["object"], job["status"], job["progress"]) == ("video", "queued", 0)
        assert (job["size"], job["seconds"], job["ditserve"]["num_frames"]) == ("32x16",
                                                                                "0.625", 5)
    for events in finished:
        assert events[-1][1]["video"]["status"] == "completed"
        assert events[-1][1]["video"]["progress"] == 100
    assert contents[0] == contents[1]  # same seed, same fake frames, same MP4
    facts = mp4_facts(contents[0])
    assert (facts["frames"], facts["width"], facts["height"], facts["fps"]) == (5, 32, 16, 8.0)
    assert 'ditserve:video_jobs_finished_total{status="completed"} 2.0' in text
    assert "ditserve:video_seconds_generated_total 1.25" in text
    assert 'ditserve:video_jobs{status="completed"} 2.0' in text
    assert "ditserve:videos_generated_total 2.0" in text


def test_a_replica_still_loading_answers_503_not_a_verdict_on_the_job(tmp_path: Path) -> None:
    """Before its model loaded, an engine knows no limits (a real one judges by an image
    model's): a POST during a restart is 503 with Retry-After, never a 400 the client would
    not retry."""
    from ditserve.engine.loop.lifecycle import EnginePhase
    from ditserve.engine.model_limits import ModelLimits

    engine = fake_video_engine(tmp_path, phase=EnginePhase.LOADING)
    engine.validate_params = lambda params: params.validate_for(ModelLimits())
    app, _ = video_app(engine)

    async def script(client):
        return await client.post(VIDEOS, json=JOB)

    response = run(app, script)
    assert response.status_code == 503, response.text
    assert "retry-after" in response.headers
    assert response.json()["error"]["code"] == "model_loading"


def test_the_unfinished_jobs_gauge_is_the_queue_an_autoscaler_reads(tmp_path: Path) -> None:
    """ditserve:video_jobs_unfinished counts every admitted job not yet done, claimed or not
    (the HPA of a deployment sharing jobs reads it: docs/kubernetes.md)."""
    app, _ = video_app(fake_video_engine(tmp_path, outcome="hang"))

    async def script(client):
        for _ in range(3):
            assert (await client.post(VIDEOS, json=JOB)).status_code == 200
        return (await client.get("/metrics")).text

    text = run(app, script)
    assert "ditserve:video_jobs_unfinished 3.0" in text


def test_the_form_the_openai_sdk_sends(tmp_path: Path) -> None:
    """seconds as OpenAI's string: frames at the native 16 fps (1 s -> 17 frames)."""
    app, _ = video_app(fake_video_engine(tmp_path))

    async def script(client):
        made = await client.post(VIDEOS, files={"prompt": (None, "a fox"),
                                                "seconds": (None, "1"),
                                                "size": (None, "16x16")})
        bad = await client.post(VIDEOS, data={"prompt": "a fox", "fps": "fast"})  # urlencoded
        upload = await client.post(VIDEOS, files={"prompt": (None, "a fox"),
                                                  "input_reference": ("f.png", b"png")})
        return made, bad, upload

    made, bad, upload = run(app, script)
    assert made.status_code == 200, made.text
    assert (made.json()["seconds"], made.json()["ditserve"]["num_frames"]) == ("1.0625", 17)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "fps"
    assert upload.status_code == 400
    assert upload.json()["error"]["code"] == "unsupported_value"


def test_range_requests_head_and_416(tmp_path: Path) -> None:
    app, _ = video_app(fake_video_engine(tmp_path))

    async def script(client):
        job = (await client.post(VIDEOS, json=JOB)).json()
        await finish(client, job["id"])
        url = f"{VIDEOS}/{job['id']}/content"
        full = await client.get(url)
        etag = full.headers["etag"]
        return full, [await client.get(url, headers=h) for h in (
            {"Range": "bytes=0-99"}, {"Range": "bytes=100-"}, {"Range": "bytes=-50"},
            {"Range": "bytes=0-1, 5-9"}, {"Range": "bytes=0-9", "If-Range": '"other"'},
            {"Range": "bytes=0-9", "If-Range": etag}, {"Range": "bytes=99999999-"},
        )], await client.head(url, headers={"Range": "bytes=10-19"})

    full, (first, rest, tail, several, stale, fresh, past), head = run(app, script)
    data, size = full.content, len(full.content)
    assert full.status_code == 200 and full.headers["content-type"] == "video/mp4"
    assert full.headers["accept-ranges"] == "bytes" and int(full.headers["content-length"]) == size
    assert (first.status_code, first.content) == (206, data[:100])
    assert first.headers["content-range"] == f"bytes 0-99/{size}"
    assert (rest.status_code, rest.content) == (206, data[100:])
    assert (tail.status_code, tail.content) == (206, data[-50:])
    assert tail.headers["content-range"] == f"bytes {size - 50}-{size - 1}/{size}"
    assert (several.status_code, several.content) == (200, data)  # RFC 9110: may ignore
    assert (stale.status_code, stale.content) == (200, data)
    assert (fresh.status_code, fresh.content) == (206, data[:10])
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{size}"
    assert past.json()["error"]["code"] == "range_not_satisfiable"
    assert head.status_code == 206 and head.content == b""
    assert head.headers["content-length"] == "10"


def test_content_of_an_unfinished_or_failed_job_is_409(tmp_path: Path) -> None:
    hanging = fake_video_engine(tmp_path, outcome="hang")
    failing = fake_video_engine(tmp_path, outcome="fail")

    async def script(client):
        job = (await client.post(VIDEOS, json=JOB)).json()
        return job, await client.get(f"{VIDEOS}/{job['id']}/content")

    _, running = run(video_app(hanging)[0], script)
    assert running.status_code == 409
    assert running.json()["error"]["code"] == "video_not_ready"
    # The OpenAI SDK would retry a 409 at once: the status says when the content is there.
    assert running.headers["x-should-retry"] == "false"

    app, _ = video_app(failing)

    async def failed_script(client):
        job = (await client.post(VIDEOS, json=JOB)).json()
        events = await finish(client, job["id"])
        return events, await client.get(f"{VIDEOS}/{job['id']}/content")

    events, content = run(app, failed_script)
    final = events[-1][1]["video"]
    assert final["status"] == "failed"
    assert final["error"]["code"] == "generation_failed"
    assert "see the server log" in final["error"]["message"]
    assert content.status_code == 409 and content.json()["error"]["code"] == "video_unavailable"
    assert content.headers["x-should-retry"] == "false"  # no retry makes a failed job's MP4


def test_a_completed_job_whose_file_is_gone_is_409_not_never_existed(tmp_path: Path) -> None:
    video_dir = tmp_path / "videos"
    app, _ = video_app(fake_video_engine(tmp_path), ServerConfig(video_dir=str(video_dir)))

    async def script(client):
        job = (await client.post(VIDEOS, json=JOB)).json()
        await finish(client, job["id"])
        for mp4 in video_dir.rglob("*.mp4"):  # lost by the result store (removed by hand)
            mp4.unlink()
        lost = await client.get(f"{VIDEOS}/{job['id']}/content")
        head = await client.head(f"{VIDEOS}/{job['id']}/content")
        await client.delete(f"{VIDEOS}/{job['id']}")
        return lost, head, await client.get(f"{VIDEOS}/{job['id']}/content")

    lost, head, deleted = run(app, script)
    assert head.status_code == 409  # no headers promising a body that is gone
    assert lost.status_code == 409, lost.text
    error = lost.json()["error"]
    assert error["code"] == "video_unavailable" and "gone from the result store" in error["message"]
    assert lost.headers["x-should-retry"] == "false"
    assert deleted.status_code == 404


def test_admission_is_the_stores_and_jobs_wait_for_room(tmp_path: Path) -> None:
    """A job waits in the store until the engine has room (it is claimed then, not
    refused); the store's bounds give 429 with Retry-After."""
    config = ServerConfig(retry_after_s=7, video_max_jobs=1)
    engine = fake_video_engine(tmp_path, outcome="queue_full")
    app, _ = video_app(engine, config)

    async def script(client):
        first = await client.post(VIDEOS, json=JOB)
        second = await client.post(VIDEOS, json=JOB)
        waiting = (await client.get(f"{VIDEOS}/{first.json()['id']}")).json()
        engine.outcome = "finish"  # a batch slot frees: the job is claimed and runs
        app.state.server.videos.worker.wake()
        return first, second, waiting, await finish(client, first.json()["id"])

    first, second, waiting, events = run(app, script)
    assert first.status_code == 200 and waiting["status"] == "queued"
    assert second.status_code == 429 and second.headers["retry-after"] == "7"
    assert "x-should-retry" not in second.headers  # a short wait: the SDK's retry may help
    assert second.json()["error"]["code"] == "store_full"
    assert "max_jobs=1" in second.json()["error"]["message"]
    final = events[-1][1]["video"]
    assert final["status"] == "completed" and final["ditserve"]["attempts"] == 1


def test_a_refused_job_leaves_no_trace(tmp_path: Path) -> None:
    app, _ = video_app(fake_video_engine(tmp_path), ServerConfig(video_max_bytes=1 << 20))

    async def script(client):
        refused = await client.post(VIDEOS, json={**JOB, "size": "512x512", "num_frames": 9})
        return refused, (await client.get(VIDEOS)).json(), (await client.get("/metrics")).text

    refused, page, text = run(app, script)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "exceeds_store"
    assert page["data"] == [] and page["has_more"] is False
    assert "ditserve:video_store_bytes 0.0" in text


def test_list_pages_by_creation_time(tmp_path: Path) -> None:
    app, _ = video_app(fake_video_engine(tmp_path, outcome="hang"))

    async def script(client):
        ids = [(await client.post(VIDEOS, json=JOB)).json()["id"] for _ in range(5)]
        pages, after = [], None
        while True:
            query = {"limit": 2, "order": "asc", **({"after": after} if after else {})}
            page = (await client.get(VIDEOS, params=query)).json()
            pages.append(page)
            if not page["has_more"]:
                break
            after = page["last_id"]
        await client.delete(f"{VIDEOS}/{ids[1]}")  # cancelled and gone: "after" still works
        newest = (await client.get(VIDEOS, params={"limit": 1})).json()
        after_gone = (await client.get(VIDEOS, params={"after": ids[1], "order": "asc"})).json()
        bad = await client.get(VIDEOS, params={"limit": 0})
        return ids, pages, newest, after_gone, bad

    ids, pages, newest, after_gone, bad = run(app, script)
    assert [[j["id"] for j in p["data"]] for p in pages] == [ids[:2], ids[2:4], ids[4:]]
    assert [p["has_more"] for p in pages] == [True, True, False]
    assert (pages[0]["first_id"], pages[0]["last_id"]) == (ids[0], ids[1])
    assert [j["id"] for j in newest["data"]] == [ids[4]] and newest["object"] == "list"
    assert [j["id"] for j in after_gone["data"]] == ids[2:]  # the cursor names a deleted job
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


def test_delete_of_an_unfinished_job_cancels_and_removes_it(tmp_path: Path, metric) -> None:
    engine = fake_video_engine(tmp_path, outcome="hang")
    app, metrics = video_app(engine)

    async def script(client):
        job = (await client.post(VIDEOS, json=JOB)).json()
        await claimed(engine)  # running on this replica: its engine request is aborted
        first = await client.delete(f"{VIDEOS}/{job['id']}")
        gone = await client.get(f"{VIDEOS}/{job['id']}")
        listed = (await client.get(VIDEOS)).json()["data"]
        second = await client.delete(f"{VIDEOS}/{job['id']}")
        return job, first, gone, listed, second, metrics.render().decode()

    job, first, gone, listed, second, text = run(app, script)
    # "deleted": true is what happened: the job is gone at once, not left behind cancelled.
    assert first.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert engine.aborted == [(job["id"], "cancelled")]  # the engine frees the slot
    assert gone.status_code == 404 and listed == []
    assert second.status_code == 404
    assert metric(text, 'ditserve:video_jobs_finished_total{status="cancelled"}') == 1


async def claimed(engine) -> None:
    """Until the replica's worker thread claimed a job and the engine holds it."""
    while not engine._handles:
        await asyncio.sleep(0.01)


def test_a_job_the_engine_dropped_goes_back_to_the_queue(tmp_path: Path) -> None:
    """An engine that stops under a job (a drain's grace ran out) hands it back: the job is
    queued again, not failed, and the next claim runs it (here, the same replica's)."""
    engine = fake_video_engine(tmp_path, outcome="hang")
    app, _ = video_app(engine)

    async def script(client):
        job = (await client.post(VIDEOS, json=JOB)).json()
        await claimed(engine)
        engine.outcome = "finish"
        engine.abort(job["id"], "engine shut down")  # what a shutdown does to what is left
        return await finish(client, job["id"])

    final = run(app, script)[-1][1]["video"]
    assert (final["status"], final["error"]) == ("completed", None)
    assert final["ditserve"]["attempts"] == 1  # a hand-back is not an attempt


def test_a_job_of_an_openai_size_is_exactly_the_sdks_video(tmp_path: Path) -> None:
    app, _ = video_app(fake_video_engine(tmp_path))

    async def script(client):
        created = (await client.post(VIDEOS, json={
            "prompt": "a tall shot", "size": "720x1280", "num_frames": 1,
            "num_inference_steps": 1, "seed": 1})).json()
        events = await finish(client, created["id"])
        return [created, *(data["video"] for _, data in events),
                (await client.get(f"{VIDEOS}/{created['id']}")).json(),
                *(await client.get(VIDEOS)).json()["data"]]

    objects = run(app, script)
    videos = [Video.model_validate(obj, strict=True) for obj in objects]
    assert [v.status for v in videos][-1] == "completed"
    assert {v.size for v in videos} == {"720x1280"}


def test_a_job_the_claiming_replica_cannot_run_fails_with_a_reason(tmp_path: Path) -> None:
    """A job another replica admitted (other limits) that this engine refuses ends failed,
    not stuck in this replica's hands."""
    from ditserve.engine.request import SamplingParams
    from ditserve.engine.server.jobs.model import VideoSpec

    app, _ = video_app(fake_video_engine(tmp_path))
    params = SamplingParams(prompt="p", height=32, width=32, num_frames=6, seed=1)  # not 4k+1

    async def script(client):
        job = app.state.server.videos.create(VideoSpec(params, fps=8, model="m"),
                                             request_id="r")
        return await finish(client, job["id"])

    final = run(app, script)[-1][1]["video"]
    assert (final["status"], final["error"]["code"]) == ("failed", "invalid_request")
    assert "num_frames" in final["error"]["message"]


def test_a_long_retry_after_also_says_not_to_retry_now() -> None:
    # The OpenAI SDK ignores a Retry-After over a minute and retries within seconds: a store
    # full of finished jobs for the next hour says so instead.
    from types import SimpleNamespace

    from ditserve.engine.server.phase import too_many

    state = SimpleNamespace(config=ServerConfig(retry_after_s=1))
    hour = too_many(state, "full", 3565, code="store_full", reason="store_full")
    assert hour.headers == {"Retry-After": "3565", "x-should-retry": "false"}
    assert too_many(state, "full", 30).headers == {"Retry-After": "30"}


def test_a_default_frame_count_the_model_cannot_make_is_said_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    app, _ = video_app(fake_video_engine(tmp_path), ServerConfig(default_frames=10))
    state = app.state.server
    with caplog.at_level(logging.WARNING, logger="ditserve.engine.server.state"):
        state.start_engine()
    assert state.video_limits().default_frames == 9  # 4k+1 at most 10
    assert "--default-frames 10: this model makes 9 frames instead" in caplog.text


def test_a_job_past_its_own_deadline_is_not_blamed_on_the_replica(tmp_path: Path) -> None:
    app, _ = video_app(fake_video_engine(tmp_path, outcome="deadline"))

    async def script(client):
        job = (await client.post(VIDEOS, json={**JOB, "deadline_s": 0.5})).json()
        return await finish(client, job["id"])

    final = run(app, script)[-1][1]["video"]
    assert final["status"] == "failed" and final["error"]["code"] == "deadline_exceeded"
    # What is left of it when a replica takes the job (the wait in the queue counts).
    assert re.match(r"deadline_s=0\.\d+ cannot be met", final["error"]["message"])
    assert "this replica" not in final["error"]["message"]


def test_a_job_whose_record_vanished_is_not_blamed_on_a_delete(tmp_path: Path) -> None:
    """A follower cannot tell a DELETE elsewhere from an expiry or a Redis that lost its
    data: its last event says so, not "cancelled by a DELETE" nobody sent."""
    import threading

    app, _ = video_app(fake_video_engine(tmp_path, outcome="hang"))
    store = app.state.server.videos.store
    real_subscribe = store.subscribe

    def subscribe_then_lose(video_id, listener):
        current = real_subscribe(video_id, listener)
        # The record goes behind the store's back, as when Redis restarts empty.
        threading.Timer(0.05, store.backend.remove, args=(video_id,)).start()
        return current

    store.subscribe = subscribe_then_lose

    async def script(client):
        job = (await client.post(VIDEOS, json=JOB)).json()
        return await finish(client, job["id"])

    final = run(app, script)[-1][1]["video"]
    assert final["status"] == "failed" and final["error"]["code"] == "cancelled"
    message = final["error"]["message"]
    assert "gone from the job store" in message and "lost with the store's data" in message
