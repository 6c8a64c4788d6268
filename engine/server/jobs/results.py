"""Where finished videos are kept: the contract of a result store, and the choice of one.

A result store holds one immutable MP4 per completed job, named by the job's id, and every
replica sharing a job store must read every result. Two implement it:

- ``VideoFiles`` (``files.py``): a directory - private, owned by one server (``--video-dir``
  with the default SQLite job store), or a ReadWriteMany volume every replica mounts;
- ``S3Results`` (``s3_results.py``): an S3-compatible bucket (``--job-results
  s3://BUCKET/PREFIX``), which every replica reads without a shared volume.

The contract: ``publish`` writes a job's MP4 so that a half-written one is never visible and
the first writer wins (a second claim of the same job learns it did not create the result,
so it never removes the winner's); ``read`` opens a byte range for the content route;
``remove`` deletes a job's result (DELETE, expiry); ``sweep`` drops results no job names
(owned directories only). Chosen by ``open_results`` from the server config; called by
``JobStore`` (remove), ``JobWorker`` (publish) and videos/routes.py (read).
"""

from __future__ import annotations

from typing import Protocol


class ResultMissing(Exception):
    """The job's result is gone (deleted or expired meanwhile): the route answers 404."""


class ResultReader(Protocol):
    """One open byte range of a result: ``read`` returns up to ``size`` bytes, b"" at the
    end of the range; ``close`` releases it (a file descriptor, an HTTP response)."""

    def read(self, size: int) -> bytes: ...

    def close(self) -> None: ...


class ResultStore(Protocol):
    """See the module docstring. ``shared``: every replica reads the same results."""

    shared: bool

    def publish(self, job_id: str, data: bytes) -> tuple[str, bool]:
        """Store ``data`` as the job's MP4: (where it is, whether this call created it -
        False when another claim of the job published first). Raises StorageError."""
        ...

    def read(self, job_id: str, start: int, end: int) -> ResultReader:
        """Bytes [start, end) of the job's MP4; raises ResultMissing."""
        ...

    def remove(self, job_id: str) -> None:
        """Delete the job's result if there is one (never raises: a leftover is logged)."""
        ...

    def sweep(self, keep: set[str]) -> None:
        """Remove the results of jobs not in ``keep`` where this server owns the store."""
        ...

    def close(self) -> None: ...
