"""The engine's last words: a fatal start error written where Kubernetes reads it.

Owns ``record_fatal``: the message goes to ``$DITSERVE_TERMINATION_LOG`` (default
``/dev/termination-log``, the container's terminationMessagePath), which the kubelet copies
into the pod's ``lastState.terminated.message`` and the operator into the deployment's status.
Only if that file exists and is writable (a pod has it; a laptop does not): outside a pod it
does nothing. Kubernetes keeps at most 4096 bytes; the end of the message is kept. Called by
``engine.cli.main`` and ``engine.server.main`` on the way out; pure Python.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TERMINATION_LOG_ENV = "DITSERVE_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
MAX_BYTES = 4096


def termination_log_path(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(TERMINATION_LOG_ENV) or DEFAULT_TERMINATION_LOG


def record_fatal(message: str, environ: Mapping[str, str] | None = None) -> bool:
    """Write ``message`` to the termination log; True if it was written."""
    path = termination_log_path(environ)
    if not os.path.isfile(path) or not os.access(path, os.W_OK):
        return False
    data = message.strip().encode("utf-8", errors="replace")
    if len(data) > MAX_BYTES:
        data = b"..." + data[-(MAX_BYTES - 3):]
    try:
        with open(path, "wb") as f:
            f.write(data)
    except OSError:
        return False  # never let the report hide the error being reported
    return True
