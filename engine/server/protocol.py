"""The HTTP/1.1 connection protocol of ``ditserve serve``: uvicorn's h11 one, whose answer to
a request it cannot parse is the API's own error, not uvicorn's plain text.

Such a request never reaches the app (a ``Content-Length: abc``, a request line or header
block longer than h11 buffers, bytes that are not HTTP), so no middleware can answer it. The
answer here is what every other error is: a 400 with OpenAI's error object (``code``
``invalid_http``) and an ``X-Request-Id``, the same id as the server's log line about it;
the connection then closes, since the stream cannot be trusted past a broken request.

Used by ``main.run_server`` (uvicorn's ``http`` setting). h11 is pure Python and always there;
uvicorn would pick httptools when it is installed, whose errors read the same through
``send_400_response``, but one parser keeps the answers the same on every machine.
"""

from __future__ import annotations

import json
import logging
import uuid

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ditserve.engine.server.edge import REQUEST_ID_HEADER
from ditserve.engine.server.errors import APIError

log = logging.getLogger(__name__)

INVALID_HTTP = ("the request is not valid HTTP/1.1 (a malformed request line or header, e.g. "
                "a Content-Length that is not a number, or a request line or header block "
                "larger than the server reads); the connection is closed")


class APIErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering unparseable requests with the API's error JSON."""

    def send_400_response(self, msg: str) -> None:
        rid = uuid.uuid4().hex
        error = APIError(400, INVALID_HTTP, code="invalid_http")
        body = json.dumps(error.body()).encode()
        log.info("request %s: 400 invalid_http (%s)", rid, msg)
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()),
                   (REQUEST_ID_HEADER.lower().encode(), rid.encode()),
                   (b"connection", b"close")]
        # h11 still lets the server answer a request the client broke (as uvicorn does).
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event) or b"")
        self.transport.close()
