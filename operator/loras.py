"""``spec.loras``: LoRA adapter files for the engine pods, mounted read-only, served as
``--lora-modules NAME=PATH``.

Each entry names an adapter and where its file (a ``.safetensors``) or directory lies: a
``hostPath`` on the GPU nodes or a ``persistentVolumeClaim`` (``claimName`` + ``subPath``).
Every engine pod mounts it read-only under ``/loras/<name>`` and the serve command gets
``--lora-modules <name>=<mounted path>`` (so the engine config file, which every rank reads,
carries them too: ``judge`` parses the flags with the engine's own parser). Called by
``spec`` (parsing), ``pod`` (volumes, mounts, args) and ``judge``; pure.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any

from ditserve.operator.spec_reader import SpecReader

LORA_MOUNT_ROOT = "/loras"
# The engine's adapter names (engine.config.adapters) that are also volume-name safe.
NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,48}[a-z0-9])?$")


@dataclass(frozen=True)
class LoraSource:
    """One adapter of ``spec.loras``: a node path, or a path inside a PVC."""

    name: str
    host_path: str | None = None
    claim_name: str | None = None
    sub_path: str = ""

    @property
    def volume(self) -> str:
        return f"lora-{self.name}"

    @property
    def is_file(self) -> bool:
        return (self.host_path or self.sub_path).endswith(".safetensors")

    @property
    def mount_path(self) -> str:
        """Where the pod sees it: the directory, or the file inside ``/loras/<name>/``."""
        base = f"{LORA_MOUNT_ROOT}/{self.name}"
        if self.is_file:
            return f"{base}/{posixpath.basename(self.host_path or self.sub_path)}"
        return base


def parse_loras(root: SpecReader) -> tuple[LoraSource, ...]:
    """``spec.loras`` as LoraSources; problems go to the reader's list."""
    out: list[LoraSource] = []
    for i, item in enumerate(root.items("loras")):
        r = SpecReader(item, f"spec.loras[{i}]", root.problems)
        name = r.text("name")
        host, pvc = r.text("hostPath"), r.child("persistentVolumeClaim")
        claim, sub = pvc.text("claimName"), pvc.text("subPath", "") or ""
        where = f"spec.loras[{i}]"
        if not isinstance(name, str) or not NAME.match(name):
            root.problems.append(f"{where}.name must be 1-50 lowercase letters, digits or '-' "
                                 f"(it names a volume and the adapter), got {name!r}")
            continue
        if (host is None) == (claim is None):
            root.problems.append(f"{where}: set exactly one of hostPath or "
                                 "persistentVolumeClaim")
            continue
        if host is not None and not host.startswith("/"):
            root.problems.append(f"{where}.hostPath must be an absolute path, got {host!r}")
        if ".." in sub.split("/") or sub.startswith("/"):
            root.problems.append(f"{where}.persistentVolumeClaim.subPath must be relative "
                                 f"without '..', got {sub!r}")
        out.append(LoraSource(name=name, host_path=host, claim_name=claim, sub_path=sub))
    names = [s.name for s in out]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        root.problems.append(f"spec.loras: adapter {dup!r} is listed twice")
    return tuple(out)


def lora_volumes(loras: tuple[LoraSource, ...]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for s in loras:
        if s.host_path is not None:
            out.append({"name": s.volume, "hostPath": {
                "path": s.host_path, "type": "File" if s.is_file else "Directory"}})
        else:
            out.append({"name": s.volume, "persistentVolumeClaim": {
                "claimName": s.claim_name, "readOnly": True}})
    return out


def lora_mounts(loras: tuple[LoraSource, ...]) -> list[dict[str, Any]]:
    out = []
    for s in loras:
        mount: dict[str, Any] = {"name": s.volume, "mountPath": s.mount_path, "readOnly": True}
        if s.claim_name and s.sub_path:
            mount["subPath"] = s.sub_path
        out.append(mount)
    return out


def lora_args(loras: tuple[LoraSource, ...]) -> list[str]:
    """``--lora-modules NAME=PATH ...`` for the serve command (nothing without loras)."""
    if not loras:
        return []
    return ["--lora-modules", *(f"{s.name}={s.mount_path}" for s in loras)]


def lora_host_paths(loras: tuple[LoraSource, ...]) -> bool:
    return any(s.host_path is not None for s in loras)
