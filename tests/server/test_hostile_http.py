"""Hostile raw HTTP against real server processes: every answer is the API's own (OpenAI's
error object, an X-Request-Id), whatever the client breaks - a cut multipart body, a
multipart body the parser refuses, a Content-Length that is no number, a 100 KB path, a
trailing slash under a forged Host - and a HEAD on a job's event stream answers at once."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from server.video_support import fake_video_engine, video_app

BOUNDARY = "ditserve-test-boundary"
FORM = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}


def multipart(fields: dict[str, str], *, closed: bool = True) -> bytes:
    parts = [f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
             for name, value in fields.items()]
    return ("".join(parts) + (f"--{BOUNDARY}--\r\n" if closed else "")).encode()


def raw_request(url: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes on a fresh socket; (status, headers, body) of the answer."""
    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):  # the server closes after a broken request
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def assert_api_error(headers: dict[str, str], body: bytes, code: str) -> dict:
    assert headers["content-type"] == "application/json" and headers["x-request-id"]
    error = httpx.Response(200, content=body).json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", code)
    return error


def test_a_truncated_multipart_body_is_a_400_not_a_dropped_field(video_server) -> None:
    fields = {"prompt": "a cut form", "size": "16x16", "num_frames": "1", "fps": "8",
              "num_inference_steps": "1"}
    cut = httpx.post(f"{video_server.url}/v1/videos", headers=FORM,
                     content=multipart(fields, closed=False))
    assert cut.status_code == 400, cut.text
    assert cut.json()["error"]["code"] == "invalid_multipart"
    assert "truncated" in cut.json()["error"]["message"]
    whole = httpx.post(f"{video_server.url}/v1/videos", headers=FORM, content=multipart(fields))
    assert whole.status_code == 200, whole.text
    assert whole.json()["ditserve"]["num_inference_steps"] == 1  # the last field counted
    httpx.delete(f"{video_server.url}/v1/videos/{whole.json()['id']}")


def test_a_multipart_parse_error_has_a_code(video_server) -> None:
    body = f"--{BOUNDARY}\r\nX-Nothing: 1\r\n\r\nvalue\r\n--{BOUNDARY}--\r\n".encode()
    response = httpx.post(f"{video_server.url}/v1/videos", headers=FORM, content=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_multipart" and "form" in error["message"]


@pytest.mark.parametrize(("request_bytes", "status", "code"), [
    (b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
     400, "invalid_http"),
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "invalid_http"),
    (b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
     404, "not_found"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 100_000, 400, "invalid_http"),
])
def test_protocol_errors_are_the_api_error_object(server, request_bytes, status,
                                                  code) -> None:
    got, headers, body = raw_request(server.url, request_bytes)
    assert got == status, body
    error = assert_api_error(headers, body, code)
    if code == "invalid_http":
        assert "not valid HTTP/1.1" in error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200  # the server carries on


@pytest.mark.parametrize("request_bytes", [
    # the client leaves 10 bytes into a 100-byte JSON body
    b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100\r\n\r\n{\"prompt\":",
    # a chunked body whose chunk size is no number: the HTTP server answers 400 and drops it
    b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
])
def test_a_body_the_client_never_finishes_is_a_disconnect_not_a_500(server, metric,
                                                                     request_bytes) -> None:
    def errors() -> str:
        return httpx.get(f"{server.url}/metrics").text

    def count(text: str, reason: str) -> float:
        return metric(text, f'ditserve:request_errors_total{{reason="{reason}"}}')

    before = errors()
    where = urlsplit(server.url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        sock.sendall(request_bytes)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(65536):  # whatever the server says before it closes
            pass
    for _ in range(100):  # the route sees the disconnect a moment after the socket closes
        after = errors()
        if count(after, "client_disconnect") > count(before, "client_disconnect"):
            break
        time.sleep(0.05)
    assert count(after, "client_disconnect") == count(before, "client_disconnect") + 1
    assert count(after, "internal") == count(before, "internal")
    assert "unhandled error" not in server.log_text()


def test_a_trailing_slash_is_a_404_naming_the_route_not_a_redirect_to_the_host(server) -> None:
    response = httpx.get(f"{server.url}/health/", headers={"Host": "evil.example"})
    assert response.status_code == 404 and "location" not in response.headers
    error = response.json()["error"]
    assert error["code"] == "not_found" and "did you mean '/health'" in error["message"]
    assert response.headers["x-request-id"]


def test_head_on_a_job_event_stream_answers_at_once(video_server) -> None:
    job = httpx.post(f"{video_server.url}/v1/videos",
                     json={"prompt": "head", "size": "16x16", "num_frames": 1,
                           "num_inference_steps": 1}).json()
    with httpx.Client(base_url=video_server.url, timeout=30) as client:  # one connection
        head = client.head(f"/v1/videos/{job['id']}/events")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-type"].startswith("text/event-stream")
        assert client.get(f"/v1/videos/{job['id']}").status_code == 200  # same connection
        missing = client.head(f"/v1/videos/video_{'0' * 32}/events")
        assert missing.status_code == 404


def test_head_on_the_events_of_a_job_that_never_ends_does_not_wait(tmp_path: Path) -> None:
    """Deterministic twin of the test above: the fake engine never finishes the job, so a
    HEAD that followed the stream would never answer (bounded here by a 30 s timeout)."""
    app, _ = video_app(fake_video_engine(tmp_path, outcome="hang"))

    async def script() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            job = (await client.post("/v1/videos", json={"prompt": "forever"})).json()
            head = await asyncio.wait_for(client.head(f"/v1/videos/{job['id']}/events"), 30)
            return head, await client.get(f"/v1/videos/{job['id']}")

    try:
        head, job = asyncio.run(script())
    finally:
        app.state.server.videos.close()
    assert head.status_code == 200 and head.content == b""
    assert job.json()["status"] == "queued"  # still running: the HEAD did not follow it
