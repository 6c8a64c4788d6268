"""Host-memory accounting of a live offload: what it pins, and what it holds twice.

The streamed blocks must live in host memory once. Two promises follow (docs/offload.md,
"Host memory"), and ``host_accounting(report)`` checks both on an ``OffloadReport``:

- page-locked bytes stay within ``PINNED_LIMIT`` (1.02x) of the streamed bytes: slabs are the
  blocks plus alignment, registered ranges are the blocks' pages, staging slots are two
  blocks at most;
- a checkpoint (or node-cache entry) that the blocks stream from is not also copied: the
  loader bound the DiT's tensors to the mapping instead of materializing them
  (``skipped_materialization``, every expected tensor bound), so the host's only bytes for
  the streamed blocks are the mapping's pages, shared through the page cache by every
  process that maps the file (they count as file-backed RSS, not anonymous memory).

The backend logs the result once when offload is enabled (a broken promise is a warning);
``bench/host_rss.py`` prints it next to the RSS it measures.
"""

from __future__ import annotations

from dataclasses import dataclass

from ditserve.engine.offload.report import OffloadReport

PINNED_LIMIT = 1.02  # pinned host bytes per streamed byte, at most


@dataclass(frozen=True)
class HostAccounting:
    """The host bytes of one offload and the promises they keep (see module docstring).

    streamed_bytes: the streamed blocks' bytes (one pass); pinned_bytes: page-locked bytes of
    the backing and the transfer; mapped_bytes: the streamed bytes read from a file mapping
    (shared pages); private_bytes: the backing's own (anonymous) host bytes.
    """

    streamed_bytes: int
    pinned_bytes: int
    mapped_bytes: int
    private_bytes: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def pinned_ratio(self) -> float:
        return self.pinned_bytes / self.streamed_bytes if self.streamed_bytes else 0.0

    def summary(self) -> str:
        where = (f"{_gib(self.mapped_bytes)} streamed from a shared file mapping"
                 if self.mapped_bytes else f"{_gib(self.private_bytes)} in private host memory")
        return (f"host memory: {_gib(self.streamed_bytes)} streamed, {where}, "
                f"{_gib(self.pinned_bytes)} pinned ({self.pinned_ratio:.3f}x streamed, "
                f"limit {PINNED_LIMIT}x)")


def host_accounting(report: OffloadReport) -> HostAccounting:
    """The accounting of ``report`` and the promises it breaks (empty: none)."""
    streamed = report.streamed_bytes
    pinned = report.pinned_host_bytes
    mapped = report.host.mapped is not None
    plan = report.host_plan
    problems = []
    if streamed and pinned > PINNED_LIMIT * streamed:
        problems.append(f"pinned host bytes {pinned} exceed {PINNED_LIMIT}x the streamed "
                        f"bytes {streamed}")
    if mapped and not plan.get("skipped_materialization", False):
        problems.append("the blocks stream from a file mapping, but the loader also "
                        "materialized the DiT in private memory")
    if mapped and plan.get("bound_tensors") != plan.get("expected_tensors"):
        problems.append(f"only {plan.get('bound_tensors')} of {plan.get('expected_tensors')} "
                        "DiT tensors are bound to the mapping; the rest are private copies")
    return HostAccounting(streamed_bytes=streamed, pinned_bytes=pinned,
                          mapped_bytes=report.host.host_bytes if mapped else 0,
                          private_bytes=0 if mapped else report.host.host_bytes,
                          problems=tuple(problems))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"
