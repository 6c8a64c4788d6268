"""Finished videos in an S3-compatible bucket (``--job-results s3://...``), against moto's S3
in server mode (a real HTTP endpoint boto3 talks to): the first result of a job wins (a
conditional PUT; a store without conditional writes gets a HEAD first), byte ranges are
ranged GETs, a DELETE removes the object, a bad bucket stops the server with a reason, and
two replicas sharing a real redis-server and the bucket (no shared volume) serve each
other's jobs, Range requests included."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from model_sources import moto_s3
from server.video_support import fake_video_engine, finish, mp4_facts, run, video_app

from ditserve.engine.errors import ConfigError
from ditserve.engine.loop.lifecycle import EnginePhase
from ditserve.engine.server.config import ServerConfig
from ditserve.engine.server.jobs.results import ResultMissing
from ditserve.engine.server.jobs.s3_results import S3Results, parse_url

BUCKET = "videos"
JOB = {"prompt": "waves at night", "size": "32x16", "num_frames": 5, "fps": 8,
       "num_inference_steps": 2, "seed": 7}
_namespaces = itertools.count()


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    import boto3

    with moto_s3() as env:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        yield client


def read_all(results: S3Results, job_id: str, start: int, end: int) -> bytes:
    reader = results.read(job_id, start, end)
    try:
        return b"".join(iter(lambda: reader.read(3), b""))
    finally:
        reader.close()


def test_the_first_result_wins_ranges_read_and_remove_deletes(s3) -> None:
    results = S3Results(f"s3://{BUCKET}/jobs/")
    job_id = "video_" + "1" * 32
    where, created = results.publish(job_id, b"the first claim's video")
    assert (where, created) == (f"s3://{BUCKET}/jobs/{job_id}.mp4", True)
    assert results.publish(job_id, b"a late second claim") == (where, False)
    assert read_all(results, job_id, 0, 23) == b"the first claim's video"
    assert read_all(results, job_id, 4, 9) == b"first"
    results.remove(job_id)
    with pytest.raises(ResultMissing):
        results.read(job_id, 0, 1)
    assert s3.list_objects_v2(Bucket=BUCKET).get("KeyCount") == 0
    results.remove(job_id)  # removing what is gone is no error


class NoConditionalWrites:
    """A store (an older MinIO, say) that answers a PUT with If-None-Match 501."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.heads = 0

    def put_object(self, **kwargs: Any) -> Any:
        from botocore.exceptions import ClientError

        if "IfNoneMatch" in kwargs:
            raise ClientError({"Error": {"Code": "NotImplemented", "Message": "no"},
                               "ResponseMetadata": {"HTTPStatusCode": 501}}, "PutObject")
        return self.client.put_object(**kwargs)

    def head_object(self, **kwargs: Any) -> Any:
        self.heads += 1
        return self.client.head_object(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def test_a_store_without_conditional_writes_is_checked_before_each_put(s3) -> None:
    client = NoConditionalWrites(s3)
    results = S3Results(f"s3://{BUCKET}", client=client)
    job_id = "video_" + "2" * 32
    assert results.publish(job_id, b"first") == (f"s3://{BUCKET}/{job_id}.mp4", True)
    assert results.publish(job_id, b"second")[1] is False
    assert read_all(results, job_id, 0, 5) == b"first" and client.heads == 2


def test_an_unreachable_bucket_is_a_503_to_retry_not_a_500(s3, tmp_path: Path) -> None:
    from botocore.exceptions import EndpointConnectionError

    app, _ = video_app(fake_video_engine(tmp_path), ServerConfig(
        job_results=f"s3://{BUCKET}/solo"))
    results = app.state.server.videos.store.files

    async def script(client):
        job = (await client.post("/v1/videos", json=JOB)).json()
        await finish(client, job["id"])

        def unreachable(**kwargs: Any) -> Any:
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")

        results._quick.get_object = unreachable  # the store goes away after the PUT
        return await client.get(f"/v1/videos/{job['id']}/content")

    response = run(app, script)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "job_store_unavailable"
    assert "retry-after" in response.headers


def test_reads_and_deletes_give_up_within_seconds_writes_retry_longer(s3) -> None:
    """botocore's defaults (60 s to connect, 60 s per read, retried) held a content request
    for minutes on a bucket that stopped answering, past every client's and ingress's
    timeout, so none saw the 503 with Retry-After."""
    from ditserve.engine.server.jobs.s3_results import S3Results

    results = S3Results(f"s3://{BUCKET}/timeouts")
    quick, patient = results._quick.meta.config, results._client.meta.config
    assert (quick.connect_timeout, quick.read_timeout, quick.retries["total_max_attempts"]
            ) == (3.0, 10.0, 2)
    assert (patient.connect_timeout, patient.read_timeout,
            patient.retries["total_max_attempts"]) == (3.0, 60.0, 6)
    results.close()


def test_a_wrong_bucket_or_url_stops_the_server_with_a_reason(s3) -> None:
    with pytest.raises(ConfigError, match="no such bucket"):
        S3Results("s3://not-there/x")
    for bad in ("s3:///prefix", "https://bucket/x", "s3://bucket/x?versionId=1"):
        with pytest.raises(ConfigError, match="s3://BUCKET"):
            parse_url(bad)
    assert parse_url("s3://b/a/b/") == ("b", "a/b/") and parse_url("s3://b") == ("b", "")


def test_two_replicas_on_redis_and_a_bucket_serve_each_others_jobs(
        s3, redis_server, tmp_path: Path) -> None:
    namespace = f"s3-{next(_namespaces)}-{tmp_path.name}"
    config = ServerConfig(job_store=redis_server.url, job_results=f"s3://{BUCKET}/wan",
                          job_namespace=namespace)  # no --video-dir: nothing shared on disk
    runner = fake_video_engine(tmp_path / "a")
    first, _ = video_app(runner, config)
    second_engine = fake_video_engine(tmp_path / "b")
    second_engine.phase = EnginePhase.DRAINING  # only the first replica runs jobs
    second, _ = video_app(second_engine, config)

    async def on_first(client):
        job = (await client.post("/v1/videos", json=JOB)).json()
        return (await finish(client, job["id"]))[-1][1]["video"]

    done = run(first, on_first, close=False)
    video_id = done["id"]
    stored = s3.get_object(Bucket=BUCKET, Key=f"wan/{video_id}.mp4")["Body"].read()

    async def on_second(client):
        url = f"/v1/videos/{video_id}/content"
        return (await client.get(f"/v1/videos/{video_id}"), await client.get(url),
                await client.get(url, headers={"Range": "bytes=10-19"}),
                await client.get(url, headers={"Range": "bytes=99999999-"}),
                await client.head(url),
                await client.delete(f"/v1/videos/{video_id}"), await client.get(url))

    try:
        polled, whole, part, past, head, deleted, after = run(second, on_second)
    finally:
        first.state.server.videos.close()
    assert done["status"] == "completed" and polled.json()["status"] == "completed"
    assert whole.status_code == 200 and whole.content == stored
    assert mp4_facts(whole.content)["frames"] == 5
    assert part.status_code == 206 and part.content == whole.content[10:20]
    assert part.headers["content-range"] == f"bytes 10-19/{len(whole.content)}"
    assert past.status_code == 416
    assert (head.status_code, head.content) == (200, b"")
    assert head.headers["content-length"] == str(len(stored))
    assert deleted.status_code == 200 and after.status_code == 404
    assert s3.list_objects_v2(Bucket=BUCKET, Prefix="wan/").get("KeyCount") == 0
