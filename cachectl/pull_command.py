"""The bodies of ``cachectl pull`` (and the pulled-model half of ``cachectl verify``).

``pull`` asks the node daemon when one answers (the daemon downloads once per node and
reports progress in its NodeCache), else pulls under the key's lock itself; ``--daemon-only``
waits for the daemon and never writes the cache (a pod with a read-only mount), and
``--no-daemon`` never asks it. Credentials travel from this process's environment (the pod's
Secret) to the daemon in the request body, over the node-local socket, and are never logged.
``--link PATH`` makes PATH a symlink to the pulled model folder, for an engine's ``--model``.
Called by ``commands.COMMANDS`` with the parsed arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from ditserve.cachectl.client import through_daemon
from ditserve.cachectl.errors import (
    CacheError,
    DaemonError,
    EntryCorruptError,
    ModelAccessError,
    ModelDigestError,
    ModelNotFoundError,
    ModelSourceError,
    Problem,
)
from ditserve.cachectl.layout import Layout, default_socket
from ditserve.cachectl.sources import Credentials

# The environment a pull authenticates with (the names huggingface_hub and boto3 read).
CREDENTIAL_ENV = {"hf_token": "HF_TOKEN", "hf_endpoint": "HF_ENDPOINT",
                  "aws_access_key_id": "AWS_ACCESS_KEY_ID",
                  "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
                  "aws_session_token": "AWS_SESSION_TOKEN", "aws_region": "AWS_REGION",
                  "s3_endpoint": "AWS_ENDPOINT_URL_S3"}
# A daemon job's failure reason -> the error this side raises (the exit status follows).
_REASONS: dict[str, type[ModelSourceError]] = {
    c.reason: c for c in (ModelNotFoundError, ModelAccessError, ModelDigestError)}


def credentials_from_env(env: dict[str, str] | os._Environ[str] = os.environ) -> Credentials:
    values = {field: env.get(name) or None for field, name in CREDENTIAL_ENV.items()}
    values["aws_region"] = values["aws_region"] or env.get("AWS_DEFAULT_REGION") or None
    values["s3_endpoint"] = values["s3_endpoint"] or env.get("AWS_ENDPOINT_URL") or None
    return Credentials(**values)


def _daemon_pull(client: Any, args: argparse.Namespace, progress: Any,
                 deadline: float) -> dict[str, Any]:
    creds = {k: v for k, v in dataclasses.asdict(credentials_from_env()).items() if v}
    last_phase = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CacheError(f"the daemon did not finish the pull within --timeout "
                             f"{args.timeout:.0f}s (last phase: {last_phase}); it keeps "
                             "downloading, run pull again")
        status, body = client.request(
            "POST", "/v1/pull", {"uri": args.uri, "credentials": creds, "workers": args.workers,
                                 "wait_s": min(5.0, left)},
            timeout_s=min(5.0, left) + client.timeout_s)
        if body.get("phase") != last_phase:
            last_phase = body.get("phase")
            progress.phase(f"daemon: {last_phase}")
        prog = body.get("progress") or {}
        progress.bytes(int(prog.get("done_bytes") or 0), int(prog.get("total_bytes") or 0))
        if status == 200:
            return {**body, "via": "daemon"}
        if status != 202:
            err = str(body.get("error") or body.get("detail") or body)
            reason = str(body.get("reason") or "")
            if reason == "corrupt":
                key = body.get("key") or "?"
                raise EntryCorruptError(key, [Problem(key, None, f"daemon says: {err}")])
            if reason in _REASONS:
                raise _REASONS[reason](args.uri, f"daemon says: {err}")
            raise CacheError(f"daemon: {err}")


def _local_pull(root: Path, args: argparse.Namespace, progress: Any) -> dict[str, Any]:
    from ditserve.cachectl.pulls import PullRequest, pull

    said = [False]

    def on_wait(_waited: float) -> None:
        if not said[0]:
            progress.phase("another process is pulling this model; waiting")
            said[0] = True

    model = pull(root, PullRequest(args.uri, credentials_from_env(), workers=args.workers,
                                   lock_timeout_s=args.timeout),
                 on_phase=progress.phase, on_progress=progress.bytes, on_wait=on_wait)
    return model.to_json()


def _pull(root: Path, args: argparse.Namespace, progress: Any, client: Any) -> dict[str, Any]:
    deadline = time.monotonic() + args.timeout
    if args.daemon_only:
        return through_daemon(
            client, lambda left: _daemon_pull(client, args, progress, time.monotonic() + left),
            timeout_s=args.timeout, on_phase=progress.phase)
    if not args.no_daemon and client.available():
        try:
            return _daemon_pull(client, args, progress, deadline)
        except DaemonError as e:  # died mid-request: its lock died too; pull here
            progress.phase(f"{e}; pulling here under the lock instead")
    return _local_pull(root, args, progress)


def _link(link: Path, model_dir: str) -> None:
    """Point ``link`` at the model folder, replacing an older link atomically."""
    if link.is_dir() and not link.is_symlink():
        raise CacheError(f"cannot link {link} to the pulled model {model_dir}: {link} is a "
                         "directory; name a path that is free or already a link")
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    try:
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        # Absolute: a relative --root gives a relative folder, which the link's own directory
        # would resolve differently.
        os.symlink(os.path.abspath(model_dir), tmp)
        os.replace(tmp, link)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise CacheError(f"cannot link {link} to the pulled model {model_dir}: "
                         f"{e.strerror or e}") from e


def cmd_pull(root: Path, args: argparse.Namespace, _loader: Any) -> int:
    from ditserve.cachectl.client import DaemonClient
    from ditserve.cachectl.model_uri import parse_model_uri
    from ditserve.cachectl.progress import Progress

    parse_model_uri(args.uri)  # a malformed URI is a usage error before anything else
    progress = Progress(enabled=not args.json)
    client = DaemonClient(args.socket or default_socket(root))
    try:
        result = _pull(root, args, progress, client)
    finally:
        progress.done()
    if args.link is not None:
        _link(args.link, result["model_dir"])
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        how = "downloaded" if result.get("downloaded") else "joined"
        print(f"ready {result['key']} {result['model_dir']} ({how})")
    return 0  # EXIT_OK (commands.py)


def verify_models(root: Path, keys: list[str] | None) -> list[tuple[str, list[Problem]]]:
    """Re-hash pulled entries (all, or those of ``keys`` that are pulled entries), each under
    its reader lease; one that gc removed meanwhile is left out."""
    from ditserve.cachectl.pulled_verify import verify_pulled_models

    return [(r.key, r.problems) for r in verify_pulled_models(Layout(root), keys)
            if not r.skipped]

