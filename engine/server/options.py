"""The `ditserve serve` command line as pure Python: the server's flags, how they and the config
file's ``server:`` section become a ``ServerConfig``, and the whole `serve` parser.

Pure (no uvicorn, fastapi or torch): ``engine.cli.main`` builds `ditserve serve` from it,
``server.main`` reads the flags with it, and the operator judges a DiffusionDeployment's
``engine.args`` with the very same parser and rules without importing the server runtime.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from dataclasses import replace
from typing import Any

from ditserve.engine.config.flags import add_engine_options
from ditserve.engine.errors import ConfigError
from ditserve.engine.server.config import (
    JOB_NAMESPACE_ENV,
    JOB_RESULTS_ENV,
    JOB_STORE_ENV,
    ServerConfig,
    validate_server,
)

SERVE_PROG = "ditserve serve"

# (flag dest) -> ServerConfig field
_SERVER_FLAGS = {
    "host": "host", "port": "port", "request_timeout": "request_timeout_s",
    "shutdown_grace": "shutdown_grace_s", "served_model_name": "model_name",
    "default_size": "default_size", "default_steps": "default_steps",
    "api_key_env": "api_key_env", "log_level": "log_level", "retry_after": "retry_after_s",
    "max_side": "max_side", "max_steps": "max_steps", "max_body_bytes": "max_body_bytes",
    "allowed_origins": "allowed_origins", "docs": "docs",
    "default_frames": "default_frames", "default_fps": "default_fps",
    "max_frames": "max_frames", "video_dir": "video_dir", "video_max_jobs": "video_max_jobs",
    "video_max_bytes": "video_max_bytes", "video_ttl": "video_ttl_s",
    "job_store": "job_store", "job_results": "job_results", "job_lease": "job_lease_s", "job_namespace": "job_namespace",
}


def _origins(text: str) -> tuple[str, ...]:
    return tuple(origin.strip() for origin in text.split(",") if origin.strip())


def add_server_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=None, help="port (default 8000; 0 picks one)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*; prefer the env var")
    g.add_argument("--api-key-env", default=None,
                   help="environment variable holding the API key (default DITSERVE_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds before an unfinished request is aborted (default 600)")
    g.add_argument("--shutdown-grace", type=float, default=None,
                   help="seconds admitted requests may finish after SIGTERM (default 30)")
    g.add_argument("--retry-after", type=int, default=None,
                   help="Retry-After seconds sent with 429 and 503 (default 1)")
    g.add_argument("--served-model-name", default=None,
                   help="model id in /v1/models (default: the model directory's name)")
    g.add_argument("--default-size", default=None,
                   help="size when a request omits it or sends 'auto' (default: from the "
                        "model, e.g. 64x64 for the tiny model, 1024x1024 for Flux.1)")
    g.add_argument("--default-steps", type=int, default=None,
                   help="num_inference_steps when omitted (default: from the model, e.g. 4 "
                        "for the tiny model and Flux.1-schnell, 28 for Flux.1-dev)")
    g.add_argument("--max-side", type=int, default=None,
                   help="largest width or height a request may ask for (default 8192)")
    g.add_argument("--max-steps", type=int, default=None,
                   help="largest num_inference_steps a request may ask for (default 1000)")
    g.add_argument("--max-body-bytes", type=int, default=None,
                   help="larger request bodies get 413 (default 1048576)")
    g.add_argument("--allowed-origins", type=_origins, default=None, metavar="ORIGINS",
                   help="comma-separated browser origins allowed by CORS, or '*' "
                        "(default: CORS off)")
    g.add_argument("--disable-docs", dest="docs", action="store_const", const=False,
                   default=None, help="do not serve the interactive API page at /docs")
    g.add_argument("--log-level", default=None,
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    v = parser.add_argument_group("video jobs (a video model: POST /v1/videos)")
    v.add_argument("--default-frames", type=int, default=None,
                   help="frames of a job that names neither num_frames nor seconds "
                        "(default: from the model, 81 for Wan)")
    v.add_argument("--default-fps", type=int, default=None,
                   help="the model's native frame rate: MP4 fps and the rate `seconds` "
                        "counts frames at (default 16, Wan's)")
    v.add_argument("--max-frames", type=int, default=None,
                   help="most frames a job may ask for (default 1025)")
    v.add_argument("--video-dir", default=None,
                   help="directory for finished MP4s, owned by this server (default: a "
                        "private temporary directory removed at exit)")
    v.add_argument("--video-max-jobs", type=int, default=None,
                   help="jobs held at once, any state (default 256); more get 429")
    v.add_argument("--video-max-bytes", type=int, default=None,
                   help="bytes of stored MP4s plus running jobs' reservations (default "
                        "4294967296); more get 429, and a job that alone reserves more "
                        "(frames x height x width x 3) gets 400")
    v.add_argument("--video-ttl", type=float, default=None,
                   help="seconds a finished job and its MP4 are kept (default 3600)")
    v.add_argument("--job-store", default=None, metavar="URL",
                   help="where jobs live: sqlite:///PATH (one replica) or "
                        "redis://HOST:PORT/DB (replicas share jobs and take work when they "
                        "have room; --video-dir must be a directory they all mount); default "
                        "$DITSERVE_JOB_STORE, else sqlite:///VIDEO_DIR/jobs.sqlite3")
    v.add_argument("--job-results", default=None, metavar="s3://BUCKET/PREFIX",
                   help="keep finished videos in an S3-compatible bucket every replica reads "
                        "(endpoint, region, credentials: AWS_ENDPOINT_URL_S3, AWS_REGION, "
                        "AWS_ACCESS_KEY_ID...) instead of --video-dir; default "
                        "$DITSERVE_JOB_RESULTS")
    v.add_argument("--job-namespace", default=None, metavar="NAME",
                   help="the jobs of a shared store that are this deployment's: its replicas "
                        "share one queue (default $DITSERVE_JOB_NAMESPACE, else the served "
                        "model name)")
    v.add_argument("--job-lease", type=float, default=None, metavar="SECONDS",
                   help="a claimed job whose replica stops renewing its lease runs elsewhere "
                        "after this long (default 30)")


def server_config_from_args(args: argparse.Namespace, base: dict[str, Any] | None = None,
                            environ: dict[str, str] | None = None) -> ServerConfig:
    config = ServerConfig.from_mapping(base or {})
    changes = {field: getattr(args, dest) for dest, field in _SERVER_FLAGS.items()
               if getattr(args, dest, None) is not None}
    config = replace(config, **changes)
    env = os.environ if environ is None else environ
    api_key = getattr(args, "api_key", None) or env.get(config.api_key_env) or None
    # The URL may hold a password: Kubernetes passes it from a Secret in the environment. A
    # value read there and refused is named by its variable: no server.* key was written.
    from_env = {field: env[variable] for field, variable in _FROM_ENVIRONMENT
                if not getattr(config, field) and env.get(variable)}
    try:
        return validate_server(replace(config, api_key=api_key, **from_env))
    except ConfigError as e:
        if not from_env:
            raise
        variables = ", ".join(f"${v}" for f, v in _FROM_ENVIRONMENT if f in from_env)
        raise ConfigError(f"{e}\n  (read from the environment: {variables})") from e


# Server options a deployment may set through the environment (when neither a flag nor the
# config file does), each with its variable.
_FROM_ENVIRONMENT = (("job_store", JOB_STORE_ENV), ("job_results", JOB_RESULTS_ENV),
                     ("job_namespace", JOB_NAMESPACE_ENV))


def build_serve_parser(prog: str = SERVE_PROG) -> argparse.ArgumentParser:
    """The parser of `ditserve serve` alone: engine options, then the server's."""
    parser = argparse.ArgumentParser(prog=prog, description="serve the OpenAI-style HTTP API")
    add_engine_options(parser)
    add_server_options(parser)
    return parser


class ServeArgsError(ValueError):
    """Arguments `ditserve serve` would refuse; the message is argparse's own complaint."""


def parse_serve_args(args: list[str] | tuple[str, ...]) -> argparse.Namespace:
    """``args`` as `ditserve serve` reads them, without printing or exiting on a mistake."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            return build_serve_parser().parse_args(list(args))
    except SystemExit:
        said = err.getvalue().strip().splitlines()
        reason = said[-1].split("error: ", 1)[-1] if said else "they ask for help, not a server"
        raise ServeArgsError(reason) from None
