"""Admission control on a real server process: auth (401, the SDK's AuthenticationError), a
burst filling the slot then the queue, queue full -> 429 (the SDK's RateLimitError), a
disconnect frees the batch slot, the offload path in /ready, and the SIGTERM drain (last: it
ends the server).

The server has one batch slot and one queue slot, so "R1 running, R2 waiting, R3 refused"
is a deterministic state, reached by reading SSE events rather than by sleeping.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

GEN = "/v1/images/generations"
KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, launch_server):
    proc = launch_server(
        tmp_path_factory.mktemp("guarded"), "--max-num-seqs", "1", "--max-queue", "1",
        "--offload", "dlo", "--shutdown-grace", "120", "--retry-after", "2",
        env={"DITSERVE_API_KEY": KEY},
    )
    yield proc
    proc.stop()


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[str, dict]]:
    event = None
    async for line in response.aiter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:") and event is not None:
            yield event, json.loads(line[5:])
            event = None


async def next_event(events: AsyncIterator[tuple[str, dict]], kind: str) -> dict:
    async for event, data in events:
        if event == kind:
            return data
    raise AssertionError(f"stream ended before {kind}")


def test_auth_guards_v1_but_not_probes(guarded) -> None:
    url = guarded.url
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": "Bearer"}):
        response = httpx.get(f"{url}/v1/models", headers=headers)
        assert response.status_code == 401, headers
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
        response = httpx.post(f"{url}{GEN}", headers=headers, json={"prompt": "cat"})
        assert response.status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200


def test_sdk_authentication_error(guarded) -> None:
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.images.generate(prompt="cat")
    assert info.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_a_burst_to_an_idle_server_fills_the_slot_then_the_queue(guarded) -> None:
    # One batch slot and one queue slot: two requests at once are both admitted (the
    # second used to be refused when both counted as waiting before the first step).
    body = {"prompt": "burst", "num_inference_steps": 2}

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=120) as client:
            responses = await asyncio.gather(*(client.post(GEN, json=body) for _ in range(2)))
        return [r.status_code for r in responses]

    assert asyncio.run(burst()) == [200, 200]


def test_ready_reports_the_offload_path(guarded) -> None:
    body = httpx.get(f"{guarded.url}/ready").json()
    offload = body["offload"]
    assert offload["enabled"] is True and offload["active"] is True
    assert offload["streamed_blocks"] == offload["blocks"] > 0
    assert body["max_num_seqs"] == 1 and body["max_queue"] == 1


def test_queue_full_then_disconnect_frees_the_slot(guarded, metric) -> None:
    long = {"prompt": "long", "seed": 1, "num_inference_steps": 1000, "stream": True}
    short = {"prompt": "short", "seed": 2, "num_inference_steps": 3, "stream": True}

    async def scenario() -> list[tuple[str, dict]]:
        async with (
            httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=120) as client,
            client.stream("POST", GEN, json=long) as r1,
        ):
            assert r1.status_code == 200
            # Keep the iterator referenced: collecting it would close R1's stream.
            events1 = sse_events(r1)
            await next_event(events1, "ditserve.progress")
            async with client.stream("POST", GEN, json=short) as r2:
                events2 = sse_events(r2)
                queued = await next_event(events2, "ditserve.queued")
                assert queued[:2] == ["queued", 0]
                refused = await client.post(GEN, json={**short, "stream": False})
                assert refused.status_code == 429
                assert refused.headers["retry-after"] == "2"
                assert refused.json()["error"]["code"] == "queue_full"
                sdk = openai.AsyncOpenAI(base_url=f"{guarded.url}/v1", api_key=KEY,
                                         max_retries=0)
                with pytest.raises(openai.RateLimitError) as info:
                    await sdk.images.generate(prompt="one too many")
                assert info.value.response.headers["retry-after"] == "2"
                await events1.aclose()
                await r1.aclose()  # the client of R1 hangs up mid-generation
                return [item async for item in events2]

    rest = asyncio.run(scenario())
    kinds = [kind for kind, _ in rest]
    assert kinds[-1] == "image_generation.completed", rest
    assert [d[1] for k, d in rest if k == "ditserve.progress"] == [1, 2, 3]
    metrics = httpx.get(f"{guarded.url}/metrics").text
    assert metric(metrics, 'ditserve:request_errors_total{reason="client_disconnect"}') == 1
    assert metric(metrics, 'ditserve:request_errors_total{reason="queue_full"}') == 2
    # R2 and the burst's two; R1 never finished
    assert metric(metrics, "ditserve:request_success_total") == 3
    assert metric(metrics, "ditserve:offload_bytes_transferred_total") > 0
    assert metric(metrics, "ditserve:num_requests_running") == 0


def test_sigterm_drains_running_requests_then_exits(guarded) -> None:
    body = {"prompt": "drain me", "seed": 3, "num_inference_steps": 300, "stream": True}

    async def scenario() -> list[tuple[str, dict]]:
        async with (
            httpx.AsyncClient(base_url=guarded.url, headers=AUTH, timeout=120) as client,
            client.stream("POST", GEN, json=body) as response,
        ):
            events = sse_events(response)
            await next_event(events, "ditserve.progress")
            guarded.process.send_signal(signal.SIGTERM)
            ready = await client.get("/ready")
            while ready.status_code == 200:  # the handler runs on the server's next tick
                ready = await client.get("/ready")
            assert ready.status_code == 503 and ready.json()["phase"] == "draining"
            refused = await client.post(GEN, json={"prompt": "late"})
            assert refused.status_code == 503
            assert refused.json()["error"]["message"] == (
                "the server is shutting down; retry on another replica")
            return [item async for item in events]

    rest = asyncio.run(scenario())
    assert rest[-1][0] == "image_generation.completed"
    assert rest[-2] == ("ditserve.progress", ["step", 300, 300])
    assert guarded.process.wait(timeout=60) == 0
    assert "engine stopped" in guarded.log_text()
