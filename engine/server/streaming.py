"""Server-Sent Events, the mechanics every stream shares (an image request's ``"stream":
true``, a video job's events): engine progress events -> an SSE byte stream.

The engine calls ``EventBridge.push`` from its loop thread; the bridge hands each event to
the request's asyncio queue with ``call_soon_threadsafe`` (asyncio queues are not
thread-safe). Every ``data:`` line is one JSON object whose ``type`` repeats the event name
(``sse``), or one of ditserve's progress arrays (``progress``). The image streams' event
names are ``generation.events``'; ``parse_sse`` reads a finished body back (clients, tests,
benches).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any


class EventBridge:
    """Thread -> asyncio handoff of one request's RequestEvents."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def push(self, event: Any) -> None:
        """Called from the engine thread (or the loop's own thread inside add_request)."""
        # A closed loop means the client is long gone; nothing to deliver.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.queue.put_nowait, event)


def sse(event: str, payload: dict[str, Any]) -> bytes:
    """One SSE message: ``event:`` line, one ``data:`` line of JSON, blank line."""
    return _message(event, {"type": event, **payload})


def progress(event: str, *values: str | int | None) -> bytes:
    """One of ditserve's progress messages (QUEUED, PROGRESS): data is a JSON array."""
    return _message(event, list(values))


def _message(event: str, data: Any) -> bytes:
    body = json.dumps(data, separators=(",", ":"))
    return f"event: {event}\ndata: {body}\n\n".encode()


def parse_sse(text: str) -> list[tuple[str, Any]]:
    """Split an SSE body into (event, data) pairs (used by clients, tests and the bench)."""
    messages = []
    for block in text.split("\n\n"):
        event, data = "message", []
        for line in block.splitlines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data:
            messages.append((event, json.loads("\n".join(data))))
    return messages
