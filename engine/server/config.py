"""ServerConfig: the HTTP server's own options (the ``server:`` section of ``--config``).

Validated once here; the engine's options stay in ``EngineConfig``. Pure Python: the
operator may render these keys, so importing this module must stay cheap.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit

from ditserve.engine.config import (
    int_at_least,
    number_at_least,
    raise_problems,
    reject_unknown_keys,
)
from ditserve.engine.errors import ConfigError

DEFAULT_API_KEY_ENV = "DITSERVE_API_KEY"
DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_UPLOAD_BYTES = 32 << 20  # an image upload route's body (OpenAI: 50 MB per image)
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096  # decoded size of one uploaded image
# The routes that take image files (multipart): their bodies may be max_upload_bytes.
UPLOAD_PATHS = frozenset({"/v1/images/edits", "/v1/videos"})
DEFAULT_VIDEO_MAX_JOBS = 256
DEFAULT_VIDEO_MAX_BYTES = 4 << 30
DEFAULT_VIDEO_TTL_S = 3600.0
DEFAULT_JOB_LEASE_S = 30.0
JOB_STORE_ENV = "DITSERVE_JOB_STORE"  # the job store URL when neither flag nor YAML names one
JOB_NAMESPACE_ENV = "DITSERVE_JOB_NAMESPACE"  # likewise, the namespace (the operator sets it)
JOB_NAMESPACE = re.compile(r"^[A-Za-z0-9._/:-]{1,200}$")
JOB_RESULTS_ENV = "DITSERVE_JOB_RESULTS"  # likewise, the result store (the operator sets it)
JOB_RESULTS_PATTERN = re.compile(r"^s3://[a-z0-9][a-z0-9.\-]{1,62}(/\S*)?$")
JOB_STORE_PATTERN = re.compile(r"^(sqlite:///.+|(redis|rediss|unix)://\S+)$")
MAX_FPS = 120  # an MP4 frame rate a job (or --default-fps) may ask for
# Sides without leading zeros and at most 5 digits: a size of thousands of digits is a format
# error, never an integer conversion (and "064" is refused as the OpenAPI pattern refuses it).
SIZE_PATTERN = re.compile(r"^(0|[1-9][0-9]{0,4})x(0|[1-9][0-9]{0,4})$")
ORIGIN_PATTERN = re.compile(r"^https?://[^/\s]+$")


# Two decimal sides that SIZE_PATTERN refused for their length only: out of range, not a
# format error (a client asking for 100000x100000 learns the maximum).
DIGITS_SIZE_PATTERN = re.compile(r"^(0|[1-9][0-9]*)x(0|[1-9][0-9]*)$")


def size_out_of_range(text: str) -> bool:
    """Whether ``text`` is 'WxH' with a side too long for ``parse_size``."""
    return SIZE_PATTERN.match(text) is None and DIGITS_SIZE_PATTERN.match(text) is not None


def parse_size(text: str) -> tuple[int, int] | None:
    """'WxH' -> (width, height); None if the text is not of that form."""
    match = SIZE_PATTERN.match(text)
    return (int(match.group(1)), int(match.group(2))) if match else None


@dataclass(frozen=True)
class ServerConfig:
    """Options of the HTTP layer.

    api_key: the Bearer token clients must send to /v1/*; None disables auth. Usually read
        from the environment variable named by ``api_key_env`` (never written in YAML).
    request_timeout_s: a request not finished after this long is aborted (504).
    shutdown_grace_s: on SIGTERM, how long admitted requests may run before they are aborted.
    retry_after_s: the Retry-After hint sent with 429 (queue full) and 503 (draining).
    model_name: the id of the served model in /v1/models; None derives it from the model dir.
    default_size / default_steps: used when a request omits size / num_inference_steps (or
        sends size "auto"); None derives them from the model (``model_defaults``).
    max_side / max_steps: the largest width or height and step count a request may ask for
        (a replica's cost bound per request); None leaves the engine's limits (8192, 1000).
    max_body_bytes: larger request bodies are refused with 413 before they are read whole.
    max_upload_bytes: the same bound for the routes that take image files (POST
        /v1/images/edits, POST /v1/videos with ``input_reference``); held in memory.
    max_image_pixels: the largest decoded width x height of one uploaded image (larger ones,
        decompression bombs included, are refused with 400 before they are decoded).
    allowed_origins: browser origins allowed by CORS ("*" for any); empty turns CORS off.
    docs: serve the interactive API page at /docs (/openapi.json is always served).

    Video replicas (a video model, /v1/videos):
    default_frames / default_fps: a job that names neither num_frames nor seconds / no fps;
        None derives them from the model (Wan: 81 frames, 16 fps).
    max_frames: the most frames a job may ask for (None: the engine's 1025).
    video_dir: where finished MP4s are kept; None: a private temporary directory, removed
        at shutdown. A configured one is owned by one server at a time (flock) and emptied
        of a previous server's files at start.
    video_max_jobs / video_max_bytes: the job store's bounds (jobs held in any state; MP4
        bytes plus unfinished jobs' reservations); over them, POST /v1/videos gets 429.
    video_ttl_s: how long a finished job and its file are kept.
    job_store: where jobs live: ``sqlite:///PATH`` or ``redis://HOST:PORT/DB`` (many
        replicas as one service; ``video_dir`` must then be a directory every replica
        mounts). None: ``$DITSERVE_JOB_STORE``, else ``sqlite:///<video_dir>/jobs.sqlite3``.
    job_results: where finished videos are kept when not in ``video_dir``:
        ``s3://BUCKET/PREFIX``, an S3-compatible bucket every replica reads (endpoint,
        region and credentials from the usual AWS environment variables). None:
        ``$DITSERVE_JOB_RESULTS``, else ``video_dir``.
    job_lease_s: how long a claimed job stays with a replica that stopped renewing its
        lease (killed, cut off) before another replica runs it.
    job_namespace: which jobs of a shared store are this deployment's (its replicas share
        one queue; another namespace in the same Redis never sees them). None:
        ``$DITSERVE_JOB_NAMESPACE``, else the served model name.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    api_key_env: str = DEFAULT_API_KEY_ENV
    request_timeout_s: float = 600.0
    shutdown_grace_s: float = 30.0
    retry_after_s: int = 1
    model_name: str | None = None
    default_size: str | None = None
    default_steps: int | None = None
    max_side: int | None = None
    max_steps: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    allowed_origins: tuple[str, ...] = ()
    docs: bool = True
    log_level: str = "info"
    default_frames: int | None = None
    default_fps: int | None = None
    max_frames: int | None = None
    video_dir: str | None = None
    video_max_jobs: int = DEFAULT_VIDEO_MAX_JOBS
    video_max_bytes: int = DEFAULT_VIDEO_MAX_BYTES
    video_ttl_s: float = DEFAULT_VIDEO_TTL_S
    job_store: str | None = None
    job_results: str | None = None
    job_lease_s: float = DEFAULT_JOB_LEASE_S
    job_namespace: str | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ServerConfig:
        """From the YAML ``server:`` section; unknown keys are an error that names them."""
        if isinstance(data, Mapping) and "api_key" in data:
            raise ConfigError(
                "server.api_key must not be written in a config file; put the key in the "
                f"environment variable named by server.api_key_env (default {DEFAULT_API_KEY_ENV})"
            )
        reject_unknown_keys(data, {f.name for f in fields(cls)} - {"api_key"}, "server")
        values = dict(data)
        if isinstance(values.get("allowed_origins"), list):
            values["allowed_origins"] = tuple(values["allowed_origins"])
        return validate_server(cls(**values))


def problems(config: ServerConfig) -> list[str]:
    out: list[str] = []
    if not isinstance(config.host, str) or not config.host:
        out.append(f"server.host must be a host name or address, got {config.host!r}")
    port = config.port
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        out.append(f"server.port must be an integer in [0, 65535], got {port!r}")
    for name in ("request_timeout_s", "shutdown_grace_s"):
        number_at_least(out, f"server.{name}", getattr(config, name), 0)
    if config.request_timeout_s == 0:
        out.append("server.request_timeout_s must be > 0")
    int_at_least(out, "server.retry_after_s", config.retry_after_s, 0)
    if config.default_size is not None and (
        not isinstance(config.default_size, str) or parse_size(config.default_size) is None
    ):
        out.append(f"server.default_size must look like '1024x1024', got {config.default_size!r}")
    elif config.default_size is not None and isinstance(config.max_side, int) \
            and max(parse_size(config.default_size) or (0, 0)) > config.max_side:
        # A default the server would refuse when a client sends it (max_side bounds the work
        # of every request); the model's own default is fitted instead (``state``).
        out.append(f"server.default_size {config.default_size} exceeds server.max_side "
                   f"{config.max_side}; lower one or raise the other")
    for name in ("default_steps", "max_side", "max_steps"):
        if getattr(config, name) is not None:
            int_at_least(out, f"server.{name}", getattr(config, name), 1)
    int_at_least(out, "server.max_body_bytes", config.max_body_bytes, 1024)
    int_at_least(out, "server.max_upload_bytes", config.max_upload_bytes, 1024)
    int_at_least(out, "server.max_image_pixels", config.max_image_pixels, 64 * 64)
    origins = config.allowed_origins
    if not isinstance(origins, tuple) or not all(
        isinstance(o, str) and (o == "*" or ORIGIN_PATTERN.match(o)) for o in origins
    ):
        out.append("server.allowed_origins must be a list of origins like "
                   f"'https://app.example.com' (or '*'), got {origins!r}")
    if not isinstance(config.docs, bool):
        out.append(f"server.docs must be true or false, got {config.docs!r}")
    if config.api_key is not None and not config.api_key:
        out.append("server.api_key must not be empty (omit it to disable auth)")
    out += _video_problems(config)
    if config.log_level not in ("critical", "error", "warning", "info", "debug", "trace"):
        out.append(f"server.log_level must be a uvicorn level name, got {config.log_level!r}")
    return out


def _redis_url_problem(url: str) -> str | None:
    """What redis-py, the engine's client, finds wrong in a Redis URL (a port that is no
    number or out of range, a broken IPv6 host, a bad query option), before a pod starts."""
    if not url.startswith(("redis:", "rediss:", "unix:")):
        return None
    from redis.connection import parse_url

    try:
        parse_url(url)
    except ValueError as e:  # its messages name the part, never the password
        return str(e)
    return None


def _video_problems(config: ServerConfig) -> list[str]:
    out: list[str] = []
    for name in ("default_frames", "default_fps", "max_frames"):
        if getattr(config, name) is not None:
            int_at_least(out, f"server.{name}", getattr(config, name), 1)
    if config.default_fps is not None and isinstance(config.default_fps, int) \
            and config.default_fps > MAX_FPS:
        out.append(f"server.default_fps must be at most {MAX_FPS}, got {config.default_fps}")
    if config.video_dir is not None and (not isinstance(config.video_dir, str)
                                         or not config.video_dir):
        out.append(f"server.video_dir must be a directory path, got {config.video_dir!r}")
    int_at_least(out, "server.video_max_jobs", config.video_max_jobs, 1)
    int_at_least(out, "server.video_max_bytes", config.video_max_bytes, 1 << 20)
    number_at_least(out, "server.video_ttl_s", config.video_ttl_s, 1)
    store = config.job_store
    if store is not None and (not isinstance(store, str) or not JOB_STORE_PATTERN.match(store)):
        out.append("server.job_store must be sqlite:///ABSOLUTE/PATH or redis://HOST:PORT/DB, "
                   f"got {_redacted(store)!r}")
    elif isinstance(store, str) and store.startswith(("redis:", "rediss:")) \
            and not re.fullmatch(r"/?|/\d+", urlsplit(store).path):
        out.append("server.job_store: a Redis URL names its database by number "
                   f"(redis://HOST:PORT/DB, e.g. /0), got {_redacted(store)!r}")
    elif isinstance(store, str) and (problem := _redis_url_problem(store)):
        out.append(f"server.job_store {_redacted(store)!r}: {problem}")
    elif (isinstance(store, str) and not store.startswith("sqlite:")
          and config.video_dir is None and config.job_results is None):
        out.append("server.job_store: a Redis job store is shared by replicas, so their videos "
                   "must be too: set server.job_results (--job-results) to an s3://BUCKET/"
                   "PREFIX, or server.video_dir (--video-dir) to a directory every replica "
                   "mounts (a ReadWriteMany volume)")
    elif (isinstance(store, str) and store.startswith("sqlite:")
          and config.video_dir is None and config.job_results is None):
        # Its records outlive the process; without a directory the videos go to a private
        # temporary one removed at exit, and a finished job's content would be gone.
        out.append("server.job_store: a SQLite file keeps jobs across restarts, so their videos "
                   "must be kept too: set server.video_dir (--video-dir) to a directory, or "
                   "server.job_results (--job-results) to s3://BUCKET/PREFIX (without "
                   "--job-store, both live in --video-dir)")
    results = config.job_results
    if results is not None and (not isinstance(results, str)
                                or not JOB_RESULTS_PATTERN.match(results)):
        out.append(f"server.job_results must be s3://BUCKET or s3://BUCKET/PREFIX, got "
                   f"{results!r}")
    # Renewed every third of it: below a second a renewal's round trip (and a busy step
    # loop) outlasts the lease, and healthy replicas take each other's jobs (as the
    # operator's spec.jobs.leaseSeconds, at least 1).
    number_at_least(out, "server.job_lease_s", config.job_lease_s, 1)
    space = config.job_namespace
    if space is not None and (not isinstance(space, str) or not JOB_NAMESPACE.match(space)):
        out.append("server.job_namespace must be 1-200 letters, digits or . _ / : -, got "
                   f"{space!r}")
    return out


def _redacted(url: object) -> object:
    """A job store URL without its password (it may come from a Secret)."""
    if isinstance(url, str) and "@" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


def validate_server(config: ServerConfig) -> ServerConfig:
    raise_problems("server", problems(config))
    return config
