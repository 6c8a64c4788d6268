"""``s3://bucket/prefix``: a model folder in an S3-compatible object store.

Lists the objects under the prefix (a prefix names a folder: ``s3://b/flux`` lists
``flux/``); the listing's keys, sizes and ETags pin the content and key the entry, so a
re-uploaded object makes a new entry. Each object's digest is its SHA-256 checksum when the
store keeps a full-object one (``ChecksumMode=ENABLED``), else its ETag when that is a plain
MD5 (single-part uploads), else none (size only). Downloads run ``workers`` objects at a
time; an object is fetched into ``.incomplete/<name>`` and resumed with a range request
(``If-Match`` its ETag) when an earlier pull was killed, then renamed into place.

boto3 takes the endpoint (``$AWS_ENDPOINT_URL_S3`` / ``$AWS_ENDPOINT_URL`` or the request's),
the region and the credentials from the environment as usual, or from the request.
Errors become the cache's: NoSuchBucket / an empty prefix -> ModelNotFoundError,
AccessDenied / bad keys / no credentials -> ModelAccessError. Called through
``sources.source_for`` by ``pulls``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ditserve.cachectl.errors import (
    ModelAccessError,
    ModelNotFoundError,
    ModelSourceError,
    PullCancelledError,
)
from ditserve.cachectl.model_uri import ModelUri
from ditserve.cachectl.sources import Credentials, RemoteFile, Snapshot, fetch_all

INCOMPLETE = ".incomplete"  # inside the model folder of a partial pull; never published
_CHUNK = 8 << 20
_ACCESS_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403",
                 "401", "ExpiredToken", "InvalidToken", "AllAccessDisabled"}
_MISSING_CODES = {"NoSuchBucket", "NoSuchKey", "404", "NotFound"}


class S3Source:
    def __init__(self, uri: ModelUri, credentials: Credentials) -> None:
        self.uri = uri
        self.credentials = credentials
        self._client: Any = None
        self._etags: dict[str, str] = {}

    def client(self, workers: int = 10) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            c = self.credentials
            session = boto3.session.Session(
                aws_access_key_id=c.aws_access_key_id, aws_secret_access_key=c.aws_secret_access_key,
                aws_session_token=c.aws_session_token, region_name=c.aws_region)
            self._client = session.client(
                "s3", endpoint_url=c.s3_endpoint or None,
                config=Config(max_pool_connections=max(10, workers),
                              retries={"max_attempts": 5, "mode": "standard"}))
        return self._client

    @contextlib.contextmanager
    def _s3_errors(self) -> Iterator[None]:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        uri = str(self.uri)
        try:
            yield
        except NoCredentialsError as e:
            raise ModelAccessError(uri, "no AWS credentials: set AWS_ACCESS_KEY_ID and "
                                        "AWS_SECRET_ACCESS_KEY (the deployment's "
                                        "credentialsSecret)") from e
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            if code in _ACCESS_CODES or status in ("401", "403"):
                raise ModelAccessError(uri, f"the object store refused access ({code}): check "
                                            "the credentials and the bucket policy") from e
            if code in _MISSING_CODES or status == "404":
                raise ModelNotFoundError(uri, f"not found ({code or status}): check the bucket "
                                              "and prefix") from e
            raise ModelSourceError(uri, f"the object store answered {code or status}: {e}") from e
        except BotoCoreError as e:
            raise ModelSourceError(uri, f"cannot talk to the object store: {e}") from e

    def resolve(self) -> Snapshot:
        prefix = self.uri.key_prefix
        objects: list[tuple[str, int, str]] = []
        with self._s3_errors():
            pages = self.client().get_paginator("list_objects_v2").paginate(
                Bucket=self.uri.bucket, Prefix=prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    name = obj["Key"][len(prefix):]
                    if not name or name.endswith("/"):  # folder markers hold no file
                        continue
                    objects.append((name, int(obj["Size"]), obj["ETag"].strip('"')))
            if not objects:
                raise ModelNotFoundError(str(self.uri), f"no objects under {prefix!r} in bucket "
                                                        f"{self.uri.bucket}")
            files = [RemoteFile(name, size, self._digest(name, etag))
                     for name, size, etag in sorted(objects)]
        self._etags = {name: etag for name, _size, etag in objects}
        listing = hashlib.sha256(repr(sorted(objects)).encode()).hexdigest()
        identity = {"schema": 1, "source": "s3", "bucket": self.uri.bucket,
                    "prefix": prefix, "listing": listing}
        return Snapshot(str(self.uri), identity, None, files)

    def _digest(self, name: str, etag: str) -> dict[str, str] | None:
        head = self.client().head_object(Bucket=self.uri.bucket, Key=self.uri.key_prefix + name,
                                         ChecksumMode="ENABLED")
        checksum = head.get("ChecksumSHA256")
        if checksum and head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT" \
                and "-" not in checksum:
            return {"algorithm": "sha256-b64", "value": checksum}
        if len(etag) == 32 and "-" not in etag:  # a multipart ETag ("<md5>-N") is no file MD5
            return {"algorithm": "md5", "value": etag}
        return None

    def download(self, snapshot: Snapshot, model_dir: Path, *, workers: int,
                 cancel: threading.Event) -> None:
        client = self.client(workers)
        todo = [f for f in snapshot.files
                if not ((model_dir / f.name).is_file()
                        and (model_dir / f.name).stat().st_size == f.size)]
        with self._s3_errors():
            fetch_all(snapshot.uri, lambda f: self._fetch(client, f, model_dir, cancel), todo,
                      workers=workers, cancel=cancel, thread_name_prefix="cachectl-s3")

    def _fetch(self, client: Any, f: RemoteFile, model_dir: Path,
               cancel: threading.Event) -> None:
        part = model_dir / INCOMPLETE / f.name
        part.parent.mkdir(parents=True, exist_ok=True)
        have = part.stat().st_size if part.exists() else 0
        if have > f.size:  # not a prefix of this object: start over
            part.unlink()
            have = 0
        if have < f.size:
            args: dict[str, Any] = {"Bucket": self.uri.bucket, "Key": self.uri.key_prefix + f.name}
            if self._etags.get(f.name):
                args["IfMatch"] = self._etags[f.name]  # the object must still be the listed one
            if have:
                args["Range"] = f"bytes={have}-"
            body = client.get_object(**args)["Body"]
            with open(part, "ab") as out:
                for chunk in body.iter_chunks(_CHUNK):
                    if cancel.is_set():
                        raise PullCancelledError(str(self.uri))
                    out.write(chunk)
        final = model_dir / f.name
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, final)
