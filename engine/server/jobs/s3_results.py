"""S3Results: finished videos in an S3-compatible bucket (``--job-results s3://BUCKET/PREFIX``).

Every replica of a deployment reads every result from the bucket, so replicas need no
shared volume (a ReadWriteMany ``--video-dir`` is the other way). A job's MP4 is the object
``<prefix>/<job id>.mp4``:

- ``publish`` is one PUT with ``If-None-Match: *``: the object appears whole or not at all,
  and when two claims of one job both finish (a replica thought dead was only slow), the
  first object stays and the second writer learns it did not create it (412), so it never
  removes the winner's. A store without conditional writes (501 NotImplemented) gets a HEAD
  first instead - a narrower window, and the two objects are the same job's video (same
  seed) either way;
- ``read`` is a ranged GET streamed to the client (the content route's Range requests map
  onto it one to one); a bucket that cannot be read is a 503 with Retry-After;
- ``remove`` deletes the object (DELETE of the job, expiry). A result whose replica died
  between its PUT and the job's record is named by no job: give the bucket a lifecycle rule
  (expire ``<prefix>/`` objects a little after ``--video-ttl``) as the backstop.

boto3 takes the endpoint (``$AWS_ENDPOINT_URL_S3`` / ``$AWS_ENDPOINT_URL``: MinIO, Ceph,
R2...), the region and the credentials (``$AWS_ACCESS_KEY_ID`` / ``$AWS_SECRET_ACCESS_KEY``,
a web identity, an instance profile) from the environment as usual. The bucket is checked
once at start (a wrong name or refused credentials stop the server with a message that says
so); a failed PUT later fails the job with ``storage_error``. Built by ``open_results``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any
from urllib.parse import urlsplit

from ditserve.engine.errors import ConfigError
from ditserve.engine.server.jobs.errors import StorageError, StoreUnavailable
from ditserve.engine.server.jobs.results import ResultMissing

log = logging.getLogger(__name__)

SUFFIX = ".mp4"
MP4 = "video/mp4"
_MISSING = {"NoSuchKey", "404", "NotFound"}
_TAKEN = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
_NO_CONDITIONS = {"NotImplemented", "501"}


CONNECT_S = 3.0  # to reach the store; a bucket that does not answer is an outage


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ("bucket", "some/prefix/"); the prefix may be empty."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ConfigError(f"server.job_results {url!r}: write s3://BUCKET or "
                          "s3://BUCKET/PREFIX (the endpoint, region and credentials come "
                          "from the AWS environment variables)")
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


class S3Results:
    """See the module docstring."""

    shared = True

    def __init__(self, url: str, *, client: Any = None) -> None:
        self.url = url
        self.bucket, self.prefix = parse_url(url)
        # Writes ride out a store's brief hiccups (an encoding thread waits); reads and
        # deletes answer an HTTP request (or run in the expiry sweep under one), so they give
        # up within seconds: the client gets 503 with Retry-After, not a hang of minutes.
        self._client = client if client is not None else _client(retries=5, read_s=60.0)
        self._quick = client if client is not None else _client(retries=1, read_s=10.0)
        self._conditional = True  # PUT with If-None-Match until the store says it cannot
        self._check()

    def _check(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._quick.head_bucket(Bucket=self.bucket)  # at start: a dead bucket says so
        except ClientError as e:
            code = _code(e)
            why = ("there is no such bucket" if code in _MISSING else
                   "the credentials are refused (check AWS_ACCESS_KEY_ID / "
                   "AWS_SECRET_ACCESS_KEY and the bucket policy)" if code in ("403", "401")
                   else f"the store answered {code}")
            raise ConfigError(f"server.job_results {self.url!r}: {why}") from e
        except BotoCoreError as e:
            raise ConfigError(f"server.job_results {self.url!r} cannot be reached ({e}): set "
                              "AWS_ENDPOINT_URL_S3 for a store other than AWS, and the "
                              "region (AWS_REGION)") from e

    def key_of(self, job_id: str) -> str:
        return f"{self.prefix}{job_id}{SUFFIX}"

    def publish(self, job_id: str, data: bytes) -> tuple[str, bool]:
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.key_of(job_id)
        where = f"s3://{self.bucket}/{key}"
        try:
            if not self._conditional and self._exists(key):
                return where, False
            try:
                self._put(key, data)
            except ClientError as e:
                if _code(e) in _TAKEN:
                    return where, False  # another claim of this job published first
                if not (self._conditional and _code(e) in _NO_CONDITIONS):
                    raise
                log.warning("the result store %s takes no conditional writes: a result is "
                            "checked with a HEAD before its PUT", self.url)
                self._conditional = False
                return self.publish(job_id, data)
        except (ClientError, BotoCoreError) as e:
            raise StorageError(f"the result store {self.url} refused the video: {e}",
                               no_space=False) from e
        return where, True

    def _put(self, key: str, data: bytes) -> None:
        extra = {"IfNoneMatch": "*"} if self._conditional else {}
        self._client.put_object(Bucket=self.bucket, Key=key, Body=data, ContentType=MP4,
                                **extra)

    def _exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self._client.head_object(Bucket=self.bucket, Key=key)
            return True
        except ClientError as e:
            if _code(e) in _MISSING:
                return False
            raise

    def read(self, job_id: str, start: int, end: int) -> ObjectRange:
        """Raises ResultMissing (a 404), or StoreUnavailable (a 503 with Retry-After) while
        the bucket cannot be read."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            answer = self._quick.get_object(Bucket=self.bucket, Key=self.key_of(job_id),
                                             Range=f"bytes={start}-{end - 1}")
        except ClientError as e:
            if _code(e) in _MISSING:
                raise ResultMissing(job_id) from None
            raise StoreUnavailable(f"the result store {self.url} refused the read "
                                   f"({_code(e)})") from e
        except BotoCoreError as e:
            raise StoreUnavailable(f"the result store {self.url} cannot be reached: {e}"
                                   ) from e
        return ObjectRange(answer["Body"])

    def remove(self, job_id: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self._quick.delete_object(Bucket=self.bucket, Key=self.key_of(job_id))
        except (ClientError, BotoCoreError) as e:
            log.warning("video %s: its object in %s was not deleted (%s); the bucket's "
                        "lifecycle rule is the backstop", job_id, self.url, e)

    def sweep(self, keep: set[str]) -> None:
        """Nothing: a shared bucket's objects go with their jobs (and its lifecycle rule)."""

    def close(self) -> None:
        for client in {id(c): c for c in (self._client, self._quick)}.values():
            with contextlib.suppress(Exception):
                client.close()


class ObjectRange:
    """A ranged GET's body, read as it arrives (a ``ResultReader``)."""

    def __init__(self, body: Any) -> None:
        self._body = body

    def read(self, size: int) -> bytes:
        return bytes(self._body.read(size))

    def close(self) -> None:
        self._body.close()


def _client(*, retries: int, read_s: float) -> Any:
    import boto3
    from botocore.config import Config

    # botocore's defaults (60 s to connect, 60 s per read, each retried) would hold a request
    # for minutes on a bucket that does not answer.
    return boto3.session.Session().client("s3", config=Config(
        retries={"max_attempts": retries, "mode": "standard"}, connect_timeout=CONNECT_S,
        read_timeout=read_s))


def _code(error: Any) -> str:
    response = getattr(error, "response", {}) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    return code or str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
