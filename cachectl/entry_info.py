"""One cache entry as ``list`` and ``gc`` see it, of either kind.

``runtime``: an entry of the engine's runtime weights (``v1/entries/<key>``, built by
``build`` / ``ensure``); ``pulled``: a model downloaded by ``cachectl pull``
(``v1/models/<key>``, with the URI it came from). Made by gc.py and pulled_gc.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUNTIME, PULLED = "runtime", "pulled"


@dataclass(frozen=True)
class EntryInfo:
    key: str
    path: Path
    bytes: int
    created_at: str | None
    last_used: float  # the entry directory's mtime: set by every join, pull or lease
    in_use: bool
    identity: dict[str, Any] | None
    problem: str | None = None
    kind: str = RUNTIME
    uri: str | None = None  # pulled entries: the source they came from

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "kind": self.kind, "uri": self.uri, "bytes": self.bytes,
                "created_at": self.created_at, "last_used": self.last_used,
                "in_use": self.in_use, "identity": self.identity, "problem": self.problem}
