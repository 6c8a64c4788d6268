"""Read-only safetensors mappings, the binding preflight, and a DiT built on them.

Owns three things:

- ``MappedSafetensors``: one safetensors file mapped ``PROT_READ``/``MAP_SHARED`` (Python's
  ``ACCESS_READ``) and typed views of its tensors. We map files ourselves instead of using
  ``safetensors.safe_open``: safetensors maps copy-on-write (writable private), and CUDA
  refuses to register a writable file mapping, while a read-only one registers with
  ``cudaHostRegisterReadOnly``. The pages are the page cache's, shared by every process.
- ``preflight``: may the DiT run on these files as they are? Every parameter and persistent
  buffer has exactly one source, names, shapes and dtypes match (no cast: a cast copies),
  nothing else is in the files (a source mixing DiT and non-DiT weights fails closed), TP=1,
  every view aligned. Returns the bindings or the reason to refuse.
- ``bind_dit``: a DiT created on the meta device (non-persistent buffers built as usual),
  whose parameters and persistent buffers become views of the mappings.

Called by ``backing_choice`` (checkpoint mmap, runtime-cache hits) and ``runtime_cache``.
"""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ditserve.cachectl.st_format import ITEMSIZE, read_header
from ditserve.engine.offload.host.weight_plan import Coverage, TensorBinding

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "F32": torch.float32,
    "I64": torch.int64, "F64": torch.float64,
    # FP8 checkpoints and their node cache entries (``FP8Linear``'s e4m3 weights).
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in _DTYPES.items()}


def torch_dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (KeyError for one we do not map)."""
    return _DTYPES[name]


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ("?" for one we do not map)."""
    return _NAMES.get(dtype, "?")


class MappedSafetensors:
    """One safetensors file, mapped read-only and shared; views of its tensors."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            tensors, _meta, expected_size = read_header(self.path)
        except ValueError as e:
            raise ValueError(f"{self.path.name}: {e}") from e
        self.tensors = tensors  # key -> HeaderTensor (absolute offsets)
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size < expected_size:
                raise ValueError(f"{self.path.name} is truncated ({size} < {expected_size} bytes)")
            self._map: mmap.mmap | None = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.length = size
        with warnings.catch_warnings():
            # torch warns that the buffer is not writable: it is read-only on purpose (a stray
            # write faults instead of silently un-sharing the page), and weights are only read.
            warnings.simplefilter("ignore", UserWarning)
            self._bytes: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)

    @property
    def address(self) -> int:
        """Start address of the mapping (page-aligned): host registration works on it."""
        return self._whole().data_ptr()

    @property
    def raw(self) -> torch.Tensor:
        """The whole mapping as flat uint8 (read-only)."""
        return self._whole()

    def _whole(self) -> torch.Tensor:
        if self._bytes is None:
            raise ValueError(f"{self.path.name} is closed")
        return self._bytes

    def view(self, key: str) -> torch.Tensor:
        """The tensor ``key``, zero-copy over the mapping, with a storage of its own bytes.

        Its own storage (not a slice of one whole-file storage): ``Tensor.is_pinned()`` asks
        the driver about the *storage's* start, so only then does a registered tensor report
        pinned when the file's header page is not registered.
        """
        info = self.tensors[key]
        dtype = _DTYPES[info.dtype]
        if not info.nbytes:
            return torch.empty(info.shape, dtype=dtype)
        self._whole()  # raises if closed
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only on purpose (see above)
            flat = torch.frombuffer(self._map, dtype=dtype,  # type: ignore[arg-type]
                                    count=info.nbytes // ITEMSIZE[info.dtype], offset=info.offset)
        return flat.view(info.shape)

    def close(self) -> None:
        """Drop our references; the mapping goes away with the last view of it.

        Never ``mmap.close()``: ``torch.frombuffer`` holds a reference to the mmap object but
        no buffer export, so closing it would unmap pages that live tensors (resident modules
        on the CPU, tensors handed back by ``disable``) still point into.
        """
        self._bytes = None
        self._map = None

    def __repr__(self) -> str:
        return f"MappedSafetensors({self.path.name}, {self.length} bytes)"


@dataclass(frozen=True)
class Expected:
    """What the DiT needs for one tensor: safetensors dtype name and shape."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Preflight:
    """The verdict: ``bindings`` when ``ok``, else the ``reason`` to fall back."""

    ok: bool
    reason: str
    bindings: dict[str, TensorBinding]
    coverage: Coverage


def expected_tensors(model: nn.Module) -> dict[str, Expected]:
    """The DiT's parameters and persistent buffers (works on a meta-device model)."""
    return {
        name: Expected(st_dtype(t.dtype), tuple(t.shape))
        for name, t in model.state_dict(keep_vars=True).items()
    }


def _refuse(reason: str, expected: int) -> Preflight:
    return Preflight(False, reason, {}, Coverage(expected, 0, 0))


def _examples(names: Sequence[str] | set[str]) -> str:
    shown = sorted(names)[:3]
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(shown) + more


def preflight(
    expected: Mapping[str, Expected],
    files: Sequence[MappedSafetensors],
) -> Preflight:
    """Check that ``files`` hold exactly the DiT's tensors as they are; bind them."""
    n = len(expected)
    if not files:
        return _refuse("no safetensors files", n)
    where: dict[str, MappedSafetensors] = {}
    for f in files:
        for key in f.tensors:
            if key in where:
                return _refuse(
                    f"duplicate source: {key} is in both {where[key].path.name} and "
                    f"{f.path.name}", n)
            where[key] = f
    extra = set(where) - set(expected)
    if extra:
        return _refuse(
            f"mixed source: {len(extra)} tensor(s) in the files are not DiT parameters or "
            f"persistent buffers ({_examples(extra)}); the DiT must be a dedicated component",
            n)
    missing = set(expected) - set(where)
    if missing:
        return _refuse(f"missing key: {_examples(missing)} has no source", n)
    bindings: dict[str, TensorBinding] = {}
    for name, want in expected.items():
        f = where[name]
        info = f.tensors[name]
        if tuple(info.shape) != want.shape:
            return _refuse(
                f"shape mismatch: {name} is {list(info.shape)} in {f.path.name}, the model "
                f"needs {list(want.shape)}", n)
        if info.dtype != want.dtype:
            return _refuse(
                f"dtype mismatch: {name} is {info.dtype} in {f.path.name}, the runtime dtype "
                f"is {want.dtype} (a cast would copy; store the weights in the serving dtype)",
                n)
        if info.dtype not in _DTYPES:
            return _refuse(f"unsupported dtype {info.dtype} for {name}", n)
        if info.offset % ITEMSIZE[info.dtype]:
            return _refuse(f"misaligned: {name} starts at byte {info.offset}", n)
        bindings[name] = TensorBinding(name, f.path, name, info.offset, info.nbytes,
                                       info.dtype, tuple(info.shape))
    return Preflight(True, "preflight passed", bindings,
                     Coverage(n, len(bindings), sum(b.nbytes for b in bindings.values())))


def source_views(
    bindings: Mapping[str, TensorBinding], files: Sequence[MappedSafetensors]
) -> dict[str, torch.Tensor]:
    by_path = {f.path: f for f in files}
    return {name: by_path[b.file].view(b.key) for name, b in bindings.items()}


def meta_dit(model_cls: Any, config: Mapping[str, Any], dtype: torch.dtype) -> nn.Module:
    """The DiT with parameters on the meta device and buffers built by its constructor.

    ``include_buffers=False``: non-persistent buffers (positional tables and the like) are
    computed by the constructor as in an ordinary load, since no file holds them.
    """
    from accelerate import init_empty_weights

    from ditserve.engine.weights.loader import keeps_float32

    def runtime(name: str) -> torch.dtype:
        # As an ordinary load: the class's keep-in-float32 modules stay float32.
        return torch.float32 if keeps_float32(model_cls, name) else dtype

    with init_empty_weights(include_buffers=False):
        model = model_cls.from_config(dict(config))
    for name, p in model.named_parameters():
        p.data = p.data.to(runtime(name))  # meta: no bytes move
    persistent = set(model.state_dict(keep_vars=True))
    for mname, module in model.named_modules():
        for bname, b in module._buffers.items():
            full = f"{mname}.{bname}" if mname else bname
            if b is not None and full in persistent and b.is_floating_point():
                module._buffers[bname] = b.to(runtime(full))
    return model


def bind_views(model: nn.Module, views: Mapping[str, torch.Tensor]) -> None:
    """Make every parameter/persistent buffer of ``model`` the matching view (no copy).

    Parameter objects are created once here (a meta Parameter cannot change device); the
    model must not be used before this returns.
    """
    model.load_state_dict(dict(views), strict=True, assign=True)
    model.eval().requires_grad_(False)


def map_dit(
    model_cls: Any,
    config: Mapping[str, Any],
    dtype: torch.dtype,
    files: Sequence[MappedSafetensors],
) -> tuple[nn.Module | None, Preflight, dict[str, torch.Tensor]]:
    """A meta-device DiT whose tensors become read-only views of ``files``, its preflight
    verdict and the views; ``(None, verdict, {})`` when the files do not fit the model."""
    model = meta_dit(model_cls, config, dtype)
    checked = preflight(expected_tensors(model), files)
    if not checked.ok:
        return None, checked, {}
    views = source_views(checked.bindings, files)
    bind_views(model, views)
    return model, checked, views
