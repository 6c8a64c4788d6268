"""A small HTTP client for the node daemon over its Unix socket (stdlib only).

Called by ``cachectl ensure`` (and usable by the engine). Raises DaemonError on transport
failures so callers can fall back to building under the lock themselves.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ditserve.cachectl.errors import CacheError, DaemonError


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class DaemonClient:
    def __init__(self, socket_path: Path | str, *, timeout_s: float = 30.0) -> None:
        self.socket_path = Path(socket_path)
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                *, timeout_s: float | None = None) -> tuple[int, dict[str, Any]]:
        conn = _UnixConnection(self.socket_path, timeout_s or self.timeout_s)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            conn.request(method, path, body=payload, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except OSError as e:
            raise DaemonError(f"cachectl daemon at {self.socket_path} unreachable: {e}") from e
        finally:
            conn.close()
        try:
            data = json.loads(raw) if raw else {}
        except ValueError as e:
            raise DaemonError(f"daemon sent a non-JSON answer ({resp.status})") from e
        return resp.status, data

    def put_bytes(self, path: str, data: bytes) -> tuple[int, dict[str, Any]]:
        """PUT raw bytes (compiled artifacts) and read the JSON answer."""
        conn = _UnixConnection(self.socket_path, self.timeout_s)
        try:
            conn.request("PUT", path, body=data,
                         headers={"Content-Type": "application/octet-stream"})
            resp = conn.getresponse()
            raw = resp.read()
        except OSError as e:
            raise DaemonError(f"cachectl daemon at {self.socket_path} unreachable: {e}") from e
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw) if raw else {}
        except ValueError as e:
            raise DaemonError(f"daemon sent a non-JSON answer ({resp.status})") from e

    def available(self) -> bool:
        """True if a daemon answers /healthz on the socket."""
        if not self.socket_path.exists():
            return False
        try:
            status, _ = self.request("GET", "/healthz", timeout_s=2.0)
        except DaemonError:
            return False
        return status == 200

    def ensure(self, model: str, dtype: str, revision: str | None, *, wait_s: float,
               sp_size: int = 1, sp_impl: str | None = None,
               component: str = "transformer",
               checkpoint: str | None = None) -> tuple[int, dict[str, Any]]:
        body = {"model": model, "dtype": dtype, "revision": revision, "wait_s": wait_s,
                "sp_size": sp_size, "sp_impl": sp_impl, "component": component,
                "checkpoint": checkpoint}
        return self.request("POST", "/v1/ensure", body, timeout_s=wait_s + self.timeout_s)

    def entry(self, key: str) -> tuple[int, dict[str, Any]]:
        return self.request("GET", f"/v1/entries/{key}")


DAEMON_POLL_S = 2.0  # how often a pod that may not write the cache asks for the daemon


def through_daemon(client: DaemonClient, ask: Callable[[float], dict[str, Any]], *,
                   timeout_s: float, on_phase: Callable[[str], None]) -> dict[str, Any]:
    """``ask(seconds_left)`` of the node's daemon, waiting for one to answer: for a process
    that may not write the cache (a read-only mount), a missing or restarting daemon is
    waited for within ``timeout_s``, never replaced by local work; a daemon error is asked
    again."""
    deadline = time.monotonic() + timeout_s
    said_waiting = False
    while True:
        if client.available():
            try:
                return ask(deadline - time.monotonic())
            except DaemonError as e:
                on_phase(f"{e}; asking the daemon again")
        elif not said_waiting:
            on_phase("waiting for the node's cachectl daemon (this pod never writes the "
                     "cache itself)")
            said_waiting = True
        if time.monotonic() + DAEMON_POLL_S > deadline:
            raise CacheError(f"no cachectl daemon answered on {client.socket_path} within "
                             f"--timeout {timeout_s:.0f}s: check the cachectl DaemonSet's pod "
                             "on this node")
        time.sleep(DAEMON_POLL_S)
