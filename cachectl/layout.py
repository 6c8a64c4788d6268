"""Where things live under a cache root. Called by every module that touches the disk.

    <root>/v1/entries/<key>/       published entries: *.safetensors + manifest.json (immutable)
    <root>/v1/recipes/<rkey>.json  recipe key -> entry key records (skip-load-on-hit)
    <root>/v1/stamps/<key>.json    stat signatures after the last full hash (hints only)
    <root>/.locks/<key>.lock       build lock, one writer per key (flock, exclusive)
    (reader leases are flocks on the entry directory itself; see locks.py)
    <root>/.tmp/<key>.<pid>.<nonce>/  publications in progress, and entries GC is deleting
    <root>/v1/models/<key>/        pulled models (``cachectl pull``): model/ + manifest.json
    <root>/.partial/<key>/         a pull in progress or interrupted (kept: the next pull resumes)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = "/var/cache/ditserve"
ROOT_ENV = "DITSERVE_CACHE_ROOT"
SOCKET_ENV = "DITSERVE_CACHECTL_SOCKET"


def default_root() -> Path:
    return Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT)


def default_socket(root: Path) -> Path:
    return Path(os.environ.get(SOCKET_ENV) or root / "cachectl.sock")


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def entries(self) -> Path:
        return self.root / "v1" / "entries"

    @property
    def recipes(self) -> Path:
        return self.root / "v1" / "recipes"

    @property
    def stamps(self) -> Path:
        return self.root / "v1" / "stamps"

    @property
    def locks(self) -> Path:
        return self.root / ".locks"

    @property
    def tmp(self) -> Path:
        return self.root / ".tmp"

    @property
    def models(self) -> Path:
        return self.root / "v1" / "models"

    @property
    def partials(self) -> Path:
        return self.root / ".partial"

    def model(self, key: str) -> Path:
        return self.models / key

    def partial(self, key: str) -> Path:
        return self.partials / key

    def entry(self, key: str) -> Path:
        return self.entries / key

    def build_lock(self, key: str) -> Path:
        return self.locks / f"{key}.lock"

    def stamp(self, key: str) -> Path:
        return self.stamps / f"{key}.json"

    def recipe(self, recipe_key: str) -> Path:
        return self.recipes / f"{recipe_key}.json"

    def create(self) -> None:
        for d in (self.entries, self.recipes, self.stamps, self.locks, self.tmp):
            d.mkdir(parents=True, exist_ok=True)
