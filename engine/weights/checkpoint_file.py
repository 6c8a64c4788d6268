"""What a DiT checkpoint file is, read from its header alone: format, key layout and tensors.

``--model`` may name a file instead of a diffusers directory: a single-file safetensors
checkpoint (Flux and FLUX.2 in BFL/ComfyUI key names, Wan and Z-Image in their original ones,
or diffusers' own), a GGUF file (city96's layout, the same names), or FP8
pre-quantized safetensors (e4m3 weights, optionally with ComfyUI's ``<layer>.scale_weight``
scales). ``inspect_checkpoint`` tells them apart by their bytes - safetensors' 8-byte header
length and JSON header, GGUF's magic - and checks that every tensor's bytes lie inside the file,
so a truncated or foreign file fails here, at start, naming the file, before torch allocates
anything (nothing here imports torch).

Which family a file holds is read from its key names (``family_of_keys``); the shape check
against the family's DiT is ``weights.dit_file``'s, after the keys are mapped.

Called by ``weights.dit_file``, the CLI (``--model FILE``) and ``model convert``.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ditserve.engine.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
# safetensors: an 8-byte little-endian header length, then that many bytes of JSON.
_SAFETENSORS_MAX_HEADER = 100 * 2**20
SAFETENSORS_DTYPES = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL",
                      "F8_E4M3", "F8_E5M2", "U16", "U32", "U64"}
FP8_DTYPES = {"F8_E4M3"}
# ComfyUI's scaled FP8 files: a per-layer scale beside the weight, and a marker tensor.
FP8_SCALE_SUFFIX = ".scale_weight"
FP8_MARKERS = {"scaled_fp8"}
# The GGUF tensor types diffusers 0.42 dequantizes (``SUPPORTED_GGUF_QUANT_TYPES``, plus the
# plain F32/F16), spelled here so the check needs no torch; a test keeps the two equal.
GGUF_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "Q6_K",
                        "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"})
# What ``model convert --to`` writes (``weights.convert``); here, torch-free, for the CLI's
# argument parser, which must not import torch to say --help.
GGUF_WRITE_TYPES = ("Q8_0", "Q4_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
CONVERT_TARGETS = ("single-file", "fp8", *(f"gguf:{t}" for t in GGUF_WRITE_TYPES))


class CheckpointFormat(str, Enum):
    """The stored forms ``--model FILE`` reads (and ``model convert --to`` writes)."""

    SINGLE_FILE = "single-file"
    GGUF = "gguf"
    FP8 = "fp8"


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: its logical shape (GGUF: unquantized) and stored type name
    (safetensors dtype such as ``BF16``/``F8_E4M3``, or a GGUF type such as ``Q8_0``)."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class CheckpointFile:
    """A checked checkpoint file: its format, the family its keys name, and its tensors."""

    path: Path
    format: CheckpointFormat
    family: str
    tensors: dict[str, TensorInfo]

    @property
    def quant_types(self) -> tuple[str, ...]:
        """The stored types of its tensors, most frequent first."""
        counts: dict[str, int] = {}
        for info in self.tensors.values():
            counts[info.dtype] = counts.get(info.dtype, 0) + 1
        return tuple(sorted(counts, key=lambda d: -counts[d]))


def is_checkpoint_file(path: str | Path) -> bool:
    """Whether ``--model`` names a file (rather than a diffusers directory)."""
    return Path(path).is_file()


def inspect_checkpoint(path: str | Path) -> CheckpointFile:
    """Read and check ``path``'s header (see the module docstring); raises ModelLoadError."""
    path = Path(path)
    if path.is_dir():
        raise ModelLoadError(f"{str(path)!r} is a directory, not a checkpoint file (a "
                             ".safetensors or .gguf file holding one DiT)")
    if not path.is_file():
        raise ModelLoadError(f"checkpoint file {str(path)!r} does not exist")
    with path.open("rb") as f:
        head = f.read(8)
    if head[:4] == GGUF_MAGIC:
        tensors = _gguf_tensors(path)
        fmt = CheckpointFormat.GGUF
    else:
        tensors = _safetensors_tensors(path, head)
        stored = {t.dtype for t in tensors.values()}
        fmt = CheckpointFormat.FP8 if stored & FP8_DTYPES else CheckpointFormat.SINGLE_FILE
        _refuse_integer_weights(path, tensors)
    family = family_of_keys(tensors)
    if family is None:
        sample = ", ".join(sorted(tensors)[:4])
        raise ModelLoadError(
            f"{str(path)!r}: its tensor names ({sample}, ...) are of no DiT family ditserve reads "
            "from a file (Flux and FLUX.2 in BFL/ComfyUI or diffusers names, Qwen-Image, Wan, "
            "Z-Image)")
    return CheckpointFile(path, fmt, family, tensors)


_NOT_WEIGHTS = frozenset({"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "BOOL"})


def _refuse_integer_weights(path: Path, tensors: dict[str, TensorInfo]) -> None:
    """A DiT's weights are floating point (F32, F16, BF16, FP8); an integer or boolean tensor
    (ComfyUI's FP8 marker aside) means a file of something else, which a cast would turn into
    a model that runs and draws noise."""
    for name, info in sorted(tensors.items()):
        if info.dtype in _NOT_WEIGHTS and name.rsplit(".", 1)[-1] not in FP8_MARKERS:
            raise ModelLoadError(
                f"{str(path)!r}: tensor {name!r} is stored as {info.dtype}; a DiT checkpoint "
                "stores its weights as floating point (F32, F16, BF16 or FP8)")


# Key markers per family (names in a file's own layout, prefixes stripped); first match wins.
_FAMILY_MARKERS = (
    # FLUX.2 before Flux: its BFL files have Flux's ``double_blocks.0.img_attn.qkv`` too, and
    # modulation shared by all blocks (BFL's ``lin``, diffusers' ``linear``).
    ("flux2", ("single_stream_modulation.lin.weight", "single_stream_modulation.linear.weight")),
    ("flux", ("double_blocks.0.img_attn.qkv.weight",
              "single_transformer_blocks.0.proj_mlp.weight")),
    ("qwen-image", ("transformer_blocks.0.img_mod.1.weight",)),
    ("wan", ("blocks.0.self_attn.q.weight", "blocks.0.attn1.to_q.weight")),
    # Z-Image: the same name in its original layout and in diffusers'
    ("z-image", ("layers.0.adaLN_modulation.0.weight",)),
)


def family_of_keys(names: object) -> str | None:
    """The family (``Family.name`` of its text-to-image/video record) a key set belongs to."""
    from ditserve.engine.weights.flux_keys import strip_prefix

    stripped = {strip_prefix(n) for n in names}  # type: ignore[attr-defined]
    for family, markers in _FAMILY_MARKERS:
        if any(m in stripped for m in markers):
            return family
    return None


def _safetensors_tensors(path: Path, head: bytes) -> dict[str, TensorInfo]:
    size = path.stat().st_size
    if len(head) < 8:
        raise ModelLoadError(f"{str(path)!r} is {size} bytes: too short to be a safetensors or "
                             "GGUF file")
    (length,) = struct.unpack("<Q", head)
    if length > _SAFETENSORS_MAX_HEADER or 8 + length > size:
        raise ModelLoadError(
            f"{str(path)!r} is neither GGUF (magic {GGUF_MAGIC!r}) nor a valid safetensors file "
            f"(its header would be {length} bytes in a {size}-byte file: wrong format or "
            "truncated)")
    with path.open("rb") as f:
        f.seek(8)
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{str(path)!r}: the safetensors header is not JSON ({e}); the "
                             "file is not a safetensors checkpoint") from e
    if not isinstance(header, dict):
        raise ModelLoadError(f"{str(path)!r}: the safetensors header is not a JSON object")
    data_bytes = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{str(path)!r}: tensor {name!r} has a malformed header entry "
                                 f"{entry!r}") from e
        if dtype not in SAFETENSORS_DTYPES:
            raise ModelLoadError(f"{str(path)!r}: tensor {name!r} has unknown dtype {dtype!r}")
        if end > data_bytes or begin > end:
            raise ModelLoadError(
                f"{str(path)!r} is truncated: tensor {name!r} needs bytes {begin}..{end} of "
                f"the data section, which has {data_bytes}")
        tensors[name] = TensorInfo(tuple(int(d) for d in shape), dtype)
    if not tensors:
        raise ModelLoadError(f"{str(path)!r} holds no tensors")
    return tensors


def _gguf_tensors(path: Path) -> dict[str, TensorInfo]:
    try:
        from gguf import GGMLQuantizationType, GGUFReader
    except ImportError as e:
        raise ModelLoadError(f"reading {str(path)!r} needs the gguf package "
                             "(pip install gguf)") from e
    size = path.stat().st_size
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, struct.error, OSError) as e:
        # gguf raises ValueError for an unknown tensor type (GGMLQuantizationType(n)) and
        # numpy errors for a header cut short.
        raise ModelLoadError(f"{str(path)!r} is not a readable GGUF file: {e}") from e
    tensors = {}
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype.name not in GGUF_TYPES:
            raise ModelLoadError(
                f"{str(path)!r}: tensor {t.name!r} is of GGUF type {qtype.name}, which ditserve "
                f"(diffusers' GGUF support) cannot dequantize; supported: "
                f"{', '.join(sorted(GGUF_TYPES))}")
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise ModelLoadError(
                f"{str(path)!r} is truncated: tensor {t.name!r} ends at byte "
                f"{int(t.data_offset) + int(t.n_bytes)} of a {size}-byte file")
        # GGUF lists dimensions fastest first; torch's order is the reverse.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = TensorInfo(shape, qtype.name)
    if not tensors:
        raise ModelLoadError(f"{str(path)!r} holds no tensors")
    return tensors
