"""/v1/videos: OpenAI's Videos API over the video jobs (``state.videos``).

POST /v1/videos answers at once with the queued job; GET /v1/videos/{id} polls it;
GET /v1/videos/{id}/events streams its changes (SSE); GET /v1/videos/{id}/content serves the
MP4 once completed, from the result store (a directory or an S3 bucket; Range requests:
206 / 416; HEAD); DELETE /v1/videos/{id} cancels an unfinished job (its batch slot frees at
the next step) or removes a finished one and its MP4; GET /v1/videos lists jobs (``limit``, ``after``, ``order``). Jobs do not depend on
connections: a client that hangs up leaves its job running.

Every route answers for every job of the job store, whichever replica created or runs it
(with a shared store, a follower of the events hears this replica's changes at once and
other replicas' by polling the store every ``EVENT_POLL_S``). Store calls run in worker
threads (a remote store must never block the event loop); an unreachable store is a 503
``job_store_unavailable`` with Retry-After (app.py).

An image replica answers these routes with 400 (one model per replica), and its OpenAPI
document leaves them out. A replica still loading its model answers a create with 503
``model_loading`` (``phase.check_loaded``): it cannot judge the job before it read its limits.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from email.utils import formatdate
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ditserve.engine.server.auth import require_api_key
from ditserve.engine.server.edge import is_head
from ditserve.engine.server.errors import NO_RETRY, APIError, invalid, request_id_of, shown
from ditserve.engine.server.fields.references import FIELD as REFERENCES
from ditserve.engine.server.fields.references import (
    as_list,
    decode_references,
    references_refused,
    takes_references,
)
from ditserve.engine.server.fields.uploads import reference_image
from ditserve.engine.server.jobs.errors import NeverFits, StoreFull, StoreUnavailable
from ditserve.engine.server.jobs.model import API_FINISHED, JOB_ID_PATTERN, deleted_object
from ditserve.engine.server.jobs.results import ResultMissing, ResultReader
from ditserve.engine.server.jobs.service import VideoJobs
from ditserve.engine.server.phase import (
    ADMISSION_ERRORS,
    admission_error,
    check_admitting,
    check_loaded,
    too_many,
)
from ditserve.engine.server.state import ServerState
from ditserve.engine.server.streaming import EventBridge, sse
from ditserve.engine.server.videos import openapi as video_openapi
from ditserve.engine.server.videos.byte_ranges import Unsatisfiable, choose_range
from ditserve.engine.server.videos.request import (
    REFERENCE_FIELDS,
    parse_video_request,
    read_body,
    reference_refused,
    takes_reference,
)

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["videos"])

DEFAULT_PAGE, MAX_PAGE = 20, 100
CHUNK_BYTES = 1 << 20
KEEPALIVE_S = 15.0  # an SSE comment this often keeps proxies from closing an idle stream
EVENT_POLL_S = 0.25  # how often a follower reads the store for other replicas' changes
MP4 = "video/mp4"


class MP4Response(Response):
    """Declares the content route's media type (FastAPI documents a route's class's)."""

    media_type = MP4


class EventStreamResponse(Response):
    media_type = "text/event-stream"


def _videos(request: Request) -> tuple[ServerState, VideoJobs]:
    state: ServerState = request.app.state.server
    if state.videos is None:
        raise APIError(400, f"this server serves the image model {state.model_name!r}: "
                            "generate images with POST /v1/images/generations (one model per "
                            "replica)", param="model", code="unsupported_model")
    return state, state.videos


def _not_found(video_id: str) -> APIError:
    return APIError(404, f"no video {shown(video_id)}: it never existed, was deleted or "
                         "expired", param="video_id",
                    code="video_not_found", reason="not_found")


@router.post("/v1/videos", response_model=None, summary="Create a video job (OpenAI videos API)",
             openapi_extra=video_openapi.CREATE_BODY, responses=video_openapi.create_answers())
async def create_video(request: Request) -> JSONResponse:
    state, videos = _videos(request)
    check_loaded(state)  # a restart: 503, not a verdict by an image model's limits
    data = await read_body(request)
    references = [(name, data.pop(name)) for name in REFERENCE_FIELDS if name in data]
    if references and not takes_reference(state.engine):
        raise reference_refused(references[0][0])  # before decoding anything
    media = as_list(data.pop(REFERENCES, None))
    if media and not takes_references(state.engine):
        raise references_refused()  # before decoding anything
    images = tuple([await reference_image(value, limits=state.upload_limits(), field=name)
                    for name, value in references])
    spec = parse_video_request(data, engine=state.engine, limits=state.video_limits(),
                               images=images,
                               last_frame=any(n == REFERENCE_FIELDS[1] for n, _ in references),
                               references=await decode_references(
                                   media, limits=state.upload_limits()))
    check_admitting(state)
    try:
        job = await asyncio.to_thread(videos.create, spec, request_id=request_id_of(request))
    except NeverFits as e:
        raise invalid("size", str(e), code="exceeds_store") from e
    except StoreFull as e:
        raise too_many(state, str(e), e.retry_after_s, code="store_full",
                       reason="store_full") from e
    except ADMISSION_ERRORS as e:
        raise admission_error(state, e) from e
    return JSONResponse(job)


_LIMIT = re.compile(r"^[0-9]{1,6}$")
LIST_PARAMETERS = {"parameters": [
    {"name": "limit", "in": "query", "required": False, "description": "jobs per page",
     "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": DEFAULT_PAGE}},
    {"name": "after", "in": "query", "required": False,
     "description": "the last id of the previous page",
     "schema": {"type": "string", "pattern": f"^{JOB_ID_PATTERN.pattern}$"}},
    {"name": "order", "in": "query", "required": False,
     "description": "by creation time: desc (newest first, default) or asc",
     "schema": {"enum": ["asc", "desc"], "default": "desc"}},
]}


def _query(request: Request) -> tuple[int, str | None, str]:
    q = request.query_params
    raw = q.get("limit")
    if raw is not None and not (_LIMIT.match(raw) and 1 <= int(raw) <= MAX_PAGE):
        raise invalid("limit", f"limit: must be an integer in [1, {MAX_PAGE}], got {shown(raw)}")
    after = q.get("after")
    if after is not None and not JOB_ID_PATTERN.fullmatch(after):
        raise invalid("after", f"after: must be a video id (video_ and 32 hex digits), got "
                               f"{shown(after)}")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", f"order: must be 'asc' or 'desc', got {shown(order)}")
    return int(raw) if raw is not None else DEFAULT_PAGE, after, order


@router.get("/v1/videos", response_model=None, summary="List video jobs (newest first)",
            openapi_extra=LIST_PARAMETERS, responses=video_openapi.list_answers())
async def list_videos(request: Request) -> dict[str, Any]:
    _, videos = _videos(request)
    limit, after, order = _query(request)
    data, more = await asyncio.to_thread(videos.store.page, limit=limit, after=after,
                                         order=order)
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


@router.get("/v1/videos/{video_id}", response_model=None, summary="A video job",
            responses=video_openapi.video_answers())
async def retrieve_video(video_id: str, request: Request) -> dict[str, Any]:
    _, videos = _videos(request)
    job = await asyncio.to_thread(videos.store.get, video_id)
    if job is None:
        raise _not_found(video_id)
    return job


@router.delete("/v1/videos/{video_id}", response_model=None,
               summary="Cancel an unfinished job, or delete a finished one and its MP4",
               responses=video_openapi.video_answers("VideoDeleted"))
async def delete_video(video_id: str, request: Request) -> dict[str, Any]:
    _, videos = _videos(request)
    if not await asyncio.to_thread(videos.delete, video_id):
        raise _not_found(video_id)
    return deleted_object(video_id)


CONTENT_PARAMETERS = {"parameters": [
    {"name": "variant", "in": "query", "required": False,
     "description": "which asset: only the MP4 ('video') is made",
     "schema": {"enum": ["video"], "default": "video"}},
    {"name": "Range", "in": "header", "required": False,
     "description": "one byte range, e.g. bytes=0-1023 (several ranges: the whole file)",
     "schema": {"type": "string"}},
]}


@router.get("/v1/videos/{video_id}/content", response_model=None,
            summary="The MP4 of a completed job (Range requests supported)",
            response_class=MP4Response,
            openapi_extra=CONTENT_PARAMETERS, responses=video_openapi.content_answers())
async def video_content(video_id: str, request: Request) -> Response:
    _, videos = _videos(request)
    variant = request.query_params.get("variant", "video")
    if variant != "video":
        raise invalid("variant", f"variant: only 'video' (the MP4) is available, got "
                                 f"{shown(variant)}")
    found = await asyncio.to_thread(videos.store.content, video_id)
    if found is None:
        raise _not_found(video_id)
    job, where = found
    if where is None:
        status = job["status"]
        ready = status not in API_FINISHED
        raise APIError(409, f"video {video_id} is {status}" + (
            f" ({job['progress']}%): download it once its status is completed" if ready
            else ": it has no content"), param="video_id",
            code="video_not_ready" if ready else "video_unavailable",
            # The OpenAI SDK retries a 409 at once; the content comes when the job's status
            # says so (poll it), or never for a failed job: let the client see the answer.
            headers=dict(NO_RETRY))
    etag = f'"{video_id}"'  # an id names one immutable file
    headers = {"Accept-Ranges": "bytes", "ETag": etag,
               "Last-Modified": formatdate(where.completed_at, usegmt=True),
               "Content-Disposition": f'attachment; filename="{video_id}.mp4"'}
    chosen = choose_range(request.headers.get("range"), where.size,
                          if_range=request.headers.get("if-range"), etag=etag)
    if isinstance(chosen, Unsatisfiable):
        raise APIError(416, f"the range {shown(request.headers.get('range'))} starts past the "
                            f"end of the {where.size}-byte video", param="Range",
                       code="range_not_satisfiable",
                       headers={"Content-Range": f"bytes */{chosen.size}"})
    start, end = chosen if chosen is not None else (0, where.size)
    headers["Content-Length"] = str(end - start)
    if chosen is not None:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{where.size}"
    head = is_head(request)
    try:
        # Opened before answering: a DELETE or an expiry from now on cannot cut the body
        # short (a file stays readable once open; an object's GET is under way). A HEAD
        # reads one byte: the headers of a file that is gone would promise a body.
        reader = await asyncio.to_thread(videos.store.files.read, video_id,
                                         start, start + 1 if head else end)
    except ResultMissing:
        if await asyncio.to_thread(videos.store.job, video_id) is None:
            raise _not_found(video_id) from None  # deleted or expired meanwhile
        # The job says completed; its result store lost the file (files removed by hand, a
        # bucket's lifecycle rule): not "never existed", and no retry brings it back.
        raise APIError(409, f"video {video_id} is completed, but its MP4 is gone from the "
                            "result store (--video-dir or --job-results); create the video "
                            "again", param="video_id", code="video_unavailable",
                       headers=dict(NO_RETRY)) from None
    if head:
        await asyncio.to_thread(reader.close)
        return Response(status_code=206 if chosen else 200, media_type=MP4, headers=headers)
    return StreamingResponse(_read(reader), status_code=206 if chosen else 200,
                             media_type=MP4, headers=headers)


async def _read(reader: ResultReader) -> AsyncIterator[bytes]:
    try:
        while chunk := await asyncio.to_thread(reader.read, CHUNK_BYTES):
            yield chunk
    finally:
        await asyncio.to_thread(reader.close)


@router.get("/v1/videos/{video_id}/events", response_model=None,
            summary="The job's changes as Server-Sent Events, until it finishes",
            response_class=EventStreamResponse,
            responses=video_openapi.events_answers())
async def video_events(video_id: str, request: Request) -> Response:
    _, videos = _videos(request)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if is_head(request):  # the stream's headers, at once: a HEAD never waits for the job
        if await asyncio.to_thread(videos.store.get, video_id) is None:
            raise _not_found(video_id)
        return Response(media_type="text/event-stream", headers=headers)
    # Job changes arrive from whichever thread made them (the engine's, a DELETE's).
    bridge = EventBridge(asyncio.get_running_loop())
    current = await asyncio.to_thread(videos.store.subscribe, video_id, bridge.push)
    if current is None:
        raise _not_found(video_id)
    return StreamingResponse(_events(videos, video_id, bridge, current),
                             media_type="text/event-stream", headers=headers)


async def _events(videos: VideoJobs, video_id: str, bridge: EventBridge,
                  current: dict[str, Any]) -> AsyncIterator[bytes]:
    """``event: video.<status>`` messages, data ``{"type": ..., "video": job}``, until the
    job finishes; a keep-alive comment when nothing changed for KEEPALIVE_S. This process's
    changes arrive through ``bridge``; others' are read from the store every EVENT_POLL_S."""
    try:
        job: dict[str, Any] = current
        sent: dict[str, Any] | None = None
        quiet = 0.0
        while True:
            if job != sent:
                yield sse(f"video.{job['status']}", {"video": job})
                sent, quiet = job, 0.0
                if job["status"] in API_FINISHED:
                    return
            try:
                job = await asyncio.wait_for(bridge.queue.get(), EVENT_POLL_S)
                continue
            except TimeoutError:
                quiet += EVENT_POLL_S
            try:
                fresh = await asyncio.to_thread(videos.store.get, video_id)
            except StoreUnavailable:
                fresh = job  # the store is down: nothing new to say yet
            job = fresh if fresh is not None else _deleted_elsewhere(job)
            if job == sent and quiet >= KEEPALIVE_S:
                quiet = 0.0
                yield b": keep-alive\n\n"
    finally:
        videos.store.unsubscribe(video_id, bridge.push)


def _deleted_elsewhere(job: dict[str, Any]) -> dict[str, Any]:
    """The last word on a job whose record is gone while this replica streamed it: a DELETE
    (on any replica), its expiry, or a store that lost its data; which, nobody here knows."""
    return {**job, "status": "failed", "error": {
        "code": "cancelled", "message": "the job is gone from the job store: deleted (a "
                                        "DELETE on any replica), expired, or lost with the "
                                        "store's data (a Redis restarted empty)"}}
