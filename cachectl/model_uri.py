"""Model source URIs: ``hf://org/repo[@revision]`` and ``s3://bucket/prefix``.

Pure parsing and validation (no network, no third-party imports), so the operator can judge
``spec.model.uri`` with the same rules ``cachectl pull`` applies. Called by ``pulls`` (the
download), the CLI and the daemon (validation of requests), and the operator's spec reader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from ditserve.cachectl.errors import UsageError

SCHEMES = ("hf", "s3")
# A hub repo id: one namespace and one name (the hub's own rule, loosely: it rejects the rest).
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")
# S3 bucket names (lowercase, digits, dots, hyphens; 3-63); a prefix is any key text.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class ModelUri:
    """One parsed source. ``revision`` only for hf (None: the hub's default branch);
    ``prefix`` only for s3 (no leading slash; empty: the whole bucket)."""

    scheme: Literal["hf", "s3"]
    repo: str = ""
    revision: str | None = None
    bucket: str = ""
    prefix: str = ""

    def __str__(self) -> str:
        if self.scheme == "hf":
            return f"hf://{self.repo}" + (f"@{self.revision}" if self.revision else "")
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def key_prefix(self) -> str:
        """The S3 key prefix to list: a prefix names a folder, so it ends with '/'."""
        return self.prefix if not self.prefix or self.prefix.endswith("/") else self.prefix + "/"


def parse_model_uri(text: str) -> ModelUri:
    """Parse and validate; a UsageError says what a valid URI looks like."""
    scheme, sep, rest = text.strip().partition("://")
    if not sep or scheme not in SCHEMES:
        raise UsageError(f"{text!r} is not a model URI: use hf://org/repo[@revision] or "
                         "s3://bucket/prefix")
    if scheme == "hf":
        repo, at, revision = rest.partition("@")
        repo = repo.strip("/")
        if not _REPO.match(repo) or ".." in repo:
            raise UsageError(f"{text!r}: the hub repository must be 'org/name' "
                             "(hf://org/repo[@revision])")
        if at and not (_REVISION.match(revision) and ".." not in revision):
            raise UsageError(f"{text!r}: the revision after '@' must be a branch, tag or "
                             "commit (letters, digits, '._/-')")
        return ModelUri("hf", repo=repo, revision=revision or None)
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise UsageError(f"{text!r}: {bucket!r} is not an S3 bucket name (3-63 lowercase "
                         "letters, digits, '.', '-')")
    if any(part == ".." for part in prefix.split("/")):
        raise UsageError(f"{text!r}: the prefix may not contain '..'")
    return ModelUri("s3", bucket=bucket, prefix=prefix.lstrip("/"))


def is_model_uri(text: str) -> bool:
    return text.partition("://")[0] in SCHEMES and "://" in text
