"""Compiled artifacts shared through the node cache, so a second replica skips compiling.

With ``--compile`` the warm-up compiles the DiT blocks (tens of seconds to minutes for a
full-size model). torch's "mega-cache" (``torch.compiler.save_cache_artifacts`` /
``load_cache_artifacts``) serializes what those compiles produced (inductor's FX graph cache,
AOTAutograd's cache, autotuning results); loaded before the first compile, the compiles of the
next process on the same node hit those caches instead of compiling again.

Owns the key and the file: ``<cache root>/v1/compile/<key>.bin``. The key is the SHA-256 of
what makes the artifacts reusable: the DiT (its config.json and its weight files' names and
sizes), the shapes the warm-up compiles (the warm-up size, the batch sizes), the backend, the
dtype, offload and sequence parallelism, the torch version and the device (the GPU's name),
and the compiled blocks' structure (``block_structure``). A process whose key differs never
loads another's artifacts.

The structure keeps replicas that trace different graphs from the same checkpoint apart
(FP8, GGUF or packed linears, LoRA wrappers, another attention processor or backend): under one
key the first one's artifacts would be published and every other one would miss them and
compile in full. It is also what torch's caching precompile would need, which puts Dynamo's
traced code into the artifacts and drops the guards it cannot serialize (on these very
things); the engine turns that precompile off today
(``compiled_blocks.turn_off_caching_precompile``: a second replica's warm-up fails with it).

Engine pods mount the cache read-only: they read artifacts from the mount and hand new ones
to the node's cachectl daemon (``PUT /v1/compile/<key>`` over its socket), which publishes
them atomically; a process that may write the root publishes itself. Everything here is best
effort: a failure to load or save is logged and the engine compiles as if there were no cache.
Single-process replicas only (the ranks of a multi-process replica compile in their own
processes). Called by ``loop.startup`` around the warm-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ditserve.cachectl.compiled import compiled_path, publish_compiled
from ditserve.engine.runner.compiled_blocks import repeated_blocks

log = logging.getLogger(__name__)

DIT_DIR = "transformer"


@dataclass(frozen=True)
class CompileKey:
    model: str  # digest of the DiT's config and weight files' names and sizes
    shapes: tuple[tuple[int, int, int], ...]  # (height, width, batch) the warm-up compiles
    backend: str
    dtype: str
    offload: bool
    sp_size: int
    torch_version: str
    device: str  # the GPU's name, or "cpu"
    blocks: str = ""  # block_structure(): the compiled blocks' module classes and processors

    @property
    def digest(self) -> str:
        doc = {**asdict(self), "shapes": [list(s) for s in self.shapes], "schema": 1}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def model_fingerprint(model_dir: Path) -> str:
    """The DiT's config.json content and its files' names and sizes (no weight bytes read)."""
    dit = model_dir / DIT_DIR
    h = hashlib.sha256()
    config = dit / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    if dit.is_dir():
        for path in sorted(dit.iterdir()):
            if path.is_file():
                h.update(f"{path.name}:{path.stat().st_size}\n".encode())
    return h.hexdigest()


def block_structure(model: torch.nn.Module) -> str:
    """SHA-256 of what the compiled blocks' traced code assumes beyond tensor shapes: for the
    first block of each repeated class, every submodule's class, each attention processor's
    class, and diffusers' active attention backend. LoRA wrappers, packed, FP8 or GGUF linears
    and other processors all change it."""
    firsts: dict[str, torch.nn.Module] = {}
    for block in repeated_blocks(model):
        firsts.setdefault(type(block).__name__, block)
    doc: dict[str, object] = {"backend": attention_backend()}
    for name, block in sorted(firsts.items()):
        doc[name] = [[path, _qualname(type(sub)),
                      _qualname(type(sub.processor)) if hasattr(sub, "processor") else None]
                     for path, sub in block.named_modules()]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def attention_backend() -> str:
    """diffusers' active attention backend (``native``, ``flash``, ...)."""
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    except ImportError:
        return "unknown"
    backend, _fn = _AttentionBackendRegistry.get_active_backend()
    return str(getattr(backend, "value", backend))


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def torch_version() -> str:
    return str(torch.__version__)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def artifact_path(root: Path, key: CompileKey) -> Path:
    return compiled_path(root, key.digest)


def load(root: Path | None, key: CompileKey) -> bool:
    """Load the artifacts of ``key`` if the cache holds them; whether it did."""
    if root is None:
        return False
    path = artifact_path(root, key)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        log.info("--compile: no compiled artifacts for this model, shapes and device in the "
                 "node cache yet (%s); compiling", path.name[:16])
        return False
    except OSError as e:
        log.warning("--compile: cannot read %s (%s); compiling", path, e)
        return False
    try:
        info = torch.compiler.load_cache_artifacts(data)
    except Exception as e:  # a corrupt or foreign file must never stop the engine
        info, why = None, str(e)
    else:
        why = "torch loaded nothing from them"  # it logs why (e.g. a bad checksum)
    if info is None:
        log.warning("--compile: the artifacts in %s do not load (%s); compiling", path, why)
        return False
    log.info("--compile: loaded %.1f MiB of compiled artifacts from the node cache (%s)",
             len(data) / 2**20, path.name[:16])
    return True


def save(root: Path | None, key: CompileKey, *, socket_path: Path | None = None) -> bool:
    """Publish what this process compiled under ``key``: into the root when it is writable,
    else through the node daemon; whether it was published."""
    if root is None:
        return False
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    data, _info = saved
    path = artifact_path(root, key)
    try:
        publish_compiled(root, key.digest, data)
    except OSError as e:
        if socket_path is None or not socket_path.exists():
            log.info("--compile: cannot write %s (%s) and no cachectl daemon to hand the "
                     "artifacts to; the next replica compiles again", path.parent, e)
            return False
        return _via_daemon(socket_path, key, data)
    log.info("--compile: saved %.1f MiB of compiled artifacts to the node cache",
             len(data) / 2**20)
    return True


def _via_daemon(socket_path: Path, key: CompileKey, data: bytes) -> bool:
    from ditserve.cachectl.client import DaemonClient
    from ditserve.cachectl.errors import DaemonError

    try:
        status, body = DaemonClient(socket_path, timeout_s=120).put_bytes(
            f"/v1/compile/{key.digest}", data)
    except DaemonError as e:
        log.info("--compile: the cachectl daemon did not take the artifacts (%s)", e)
        return False
    if status != 200:
        log.info("--compile: the cachectl daemon refused the artifacts (%s: %s)", status,
                 body.get("error"))
        return False
    log.info("--compile: handed %.1f MiB of compiled artifacts to the node's cachectl daemon",
             len(data) / 2**20)
    return True
