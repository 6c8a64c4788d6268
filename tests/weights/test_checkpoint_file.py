"""Checkpoint files are checked at start, from their headers: format and family detected; a
truncated file, a foreign file, an unknown or unsupported GGUF type, or tensors that do not fit
the base model's DiT are refused with an error naming the file (and the first mismatching key
with both shapes) - before the engine loads anything."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from weights.support import wide_flux  # type: ignore[import-not-found]

from ditserve.engine.cli.main import main as ditserve_main
from ditserve.engine.errors import ModelLoadError
from ditserve.engine.weights.checkpoint_file import (
    GGUF_TYPES,
    CheckpointFormat,
    inspect_checkpoint,
)
from ditserve.engine.weights.convert import convert
from ditserve.engine.weights.dit_file import check_checkpoint


@pytest.fixture(scope="module")
def files(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("files")
    out = {}
    for to, name in (("single-file", "f.safetensors"), ("gguf:Q8_0", "f.gguf"),
                     ("fp8", "f8.safetensors")):
        out[to] = root / name
        convert(tiny_model_dir, out[to], to=to)
    return out


def test_formats_and_family_are_detected(files: dict[str, Path]) -> None:
    single, gguf_file, fp8 = (inspect_checkpoint(files[k])
                              for k in ("single-file", "gguf:Q8_0", "fp8"))
    assert (single.format, gguf_file.format, fp8.format) == (
        CheckpointFormat.SINGLE_FILE, CheckpointFormat.GGUF, CheckpointFormat.FP8)
    assert single.family == gguf_file.family == fp8.family == "flux"
    assert "double_blocks.0.img_attn.qkv.weight" in single.tensors  # BFL names
    assert "Q8_0" in gguf_file.quant_types and "F8_E4M3" in fp8.quant_types
    # GGUF shapes are reported in torch's order, unquantized
    assert (gguf_file.tensors["double_blocks.0.img_attn.qkv.weight"].shape
            == single.tensors["double_blocks.0.img_attn.qkv.weight"].shape)


@pytest.mark.parametrize("kind", ["single-file", "gguf:Q8_0"])
def test_truncated_file_is_refused_naming_it(files: dict[str, Path], tmp_path: Path,
                                            kind: str) -> None:
    data = files[kind].read_bytes()
    cut = tmp_path / files[kind].name
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelLoadError, match="truncated") as e:
        inspect_checkpoint(cut)
    assert str(cut) in str(e.value)


def test_foreign_file_is_refused_naming_it(tmp_path: Path) -> None:
    for i, content in enumerate((b"not a model at all, just text\n" * 10, b"\x00" * 3)):
        path = tmp_path / f"x{i}.safetensors"
        path.write_bytes(content)
        with pytest.raises(ModelLoadError) as e:
            inspect_checkpoint(path)
        assert str(path) in str(e.value)


def _gguf_with_type(path: Path, raw_type: int | None, qtype: str = "F32") -> None:
    """A one-tensor Flux-named GGUF; ``raw_type`` overwrites the tensor's type id on disk."""
    import gguf

    writer = gguf.GGUFWriter(path=None, arch="flux")
    name = "double_blocks.0.img_attn.qkv.weight"
    if qtype == "F32":
        writer.add_tensor(name, np.zeros((96, 32), dtype=np.float32))
    else:  # raw bytes of a type gguf knows but diffusers cannot dequantize
        q = gguf.GGMLQuantizationType[qtype]
        block, size = gguf.GGML_QUANT_SIZES[q]
        writer.add_tensor(name, np.zeros((96, 256 // block * size), dtype=np.uint8),
                          raw_shape=(96, 256 // block * size), raw_dtype=q)
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if raw_type is not None:
        data = bytearray(path.read_bytes())
        at = data.index(name.encode()) + len(name)
        # tensor info after the name: n_dims (u32), n_dims x u64 dims, then the type (u32)
        n_dims = struct.unpack_from("<I", data, at)[0]
        struct.pack_into("<I", data, at + 4 + 8 * n_dims, raw_type)
        path.write_bytes(bytes(data))


def test_unknown_gguf_type_is_refused_naming_the_file(tmp_path: Path) -> None:
    good = tmp_path / "good.gguf"
    _gguf_with_type(good, None)
    assert inspect_checkpoint(good).quant_types == ("F32",)
    bad = tmp_path / "bad.gguf"
    _gguf_with_type(bad, 250)
    with pytest.raises(ModelLoadError, match="not a readable GGUF") as e:
        inspect_checkpoint(bad)
    assert str(bad) in str(e.value)


def test_gguf_type_diffusers_cannot_dequantize_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "iq.gguf"
    _gguf_with_type(path, None, qtype="IQ2_XXS")
    with pytest.raises(ModelLoadError, match="IQ2_XXS.*cannot dequantize"):
        inspect_checkpoint(path)


def test_gguf_types_are_diffusers_supported_ones() -> None:
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    assert {t.name for t in SUPPORTED_GGUF_QUANT_TYPES} | {"F32", "F16"} == GGUF_TYPES


def test_file_of_other_shapes_is_refused_with_key_and_both_shapes(
        tiny_model_dir: Path, files: dict[str, Path], tmp_path: Path) -> None:
    wide = wide_flux(tiny_model_dir, tmp_path / "wide")
    assert check_checkpoint(files["single-file"], tiny_model_dir).family == "flux"
    with pytest.raises(ModelLoadError) as e:
        check_checkpoint(files["single-file"], wide)
    message = str(e.value)
    assert str(files["single-file"]) in message
    # the first tensor in the model's order whose shape differs, with both shapes
    assert "time_text_embed.timestep_embedder.linear_1.weight is [32, 256] in the file but " \
           "[256, 256] in the model" in message


def test_integer_weights_are_refused_naming_the_tensor(files: dict[str, Path],
                                                       tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(str(files["single-file"]))
    name = sorted(k for k, v in state.items() if v.dim() == 2)[0]
    state[name] = state[name].to(torch.int32)  # a file of something else, not a DiT's weights
    path = tmp_path / "ints.safetensors"
    save_file(state, str(path))
    with pytest.raises(ModelLoadError, match=f"{name}' is stored as I32"):
        inspect_checkpoint(path)
    # FP8 files keep ComfyUI's marker tensor beside float weights, and bf16 files are bf16:
    # both accepted
    assert inspect_checkpoint(files["fp8"]).family == "flux"
    state = {k: v.to(torch.bfloat16) for k, v in load_file(str(files["single-file"])).items()}
    save_file(state, str(tmp_path / "bf16.safetensors"))
    assert inspect_checkpoint(tmp_path / "bf16.safetensors").family == "flux"


def test_file_of_no_known_family_is_refused(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "unet.safetensors"
    save_file({"down_blocks.0.conv.weight": torch.zeros(2, 2)}, str(path))
    with pytest.raises(ModelLoadError, match="no DiT family"):
        inspect_checkpoint(path)


def test_cli_refuses_a_truncated_file_before_loading(tiny_model_dir: Path,
                                                     files: dict[str, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(files["gguf:Q8_0"].read_bytes()[:-64])
    code = ditserve_main(["generate", "--model", str(cut), "--base-model", str(tiny_model_dir),
                          "--device", "cpu", "--prompt", "a cat", "--steps", "1",
                          "--out", str(tmp_path / "x.png")])
    assert code == 2
    err = capsys.readouterr().err
    assert str(cut) in err and "truncated" in err
    assert not (tmp_path / "x.png").exists()


def test_a_file_where_a_directory_is_needed_says_what_to_do(
        files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ditserve.cachectl.cli import main as cachectl_main

    code = cachectl_main(["build", "--model", str(files["gguf:Q8_0"]),
                          "--root", str(tmp_path / "cache")])
    assert code == 2  # a usage error
    err = capsys.readouterr().err
    assert "is a checkpoint file: pass it with --base-model DIR" in err


def test_option_rules_for_checkpoint_files() -> None:
    from ditserve.engine.config import EngineConfig
    from ditserve.engine.errors import ConfigError

    base = {"model": "/models/flux", "checkpoint": "/models/flux.gguf"}
    assert EngineConfig.from_mapping(base).checkpoint == "/models/flux.gguf"
    for extra, why in (({"quantization": "fp8"}, "drop --quantization"),
                       ({"adapters": {"fuse": True}}, "drop --lora-fuse")):
        with pytest.raises(ConfigError, match=why):
            EngineConfig.from_mapping({**base, **extra})
    with pytest.raises(ConfigError, match="--base-model"):
        EngineConfig.from_mapping({"checkpoint": "/models/flux.gguf"})
    # the node cache holds a checkpoint file's DiT as stored (tests/weights/test_checkpoint_cache)
    cached = EngineConfig.from_mapping(
        {**base, "offload": {"enabled": True, "runtime_cache": True}})
    assert cached.offload.runtime_cache and cached.checkpoint == "/models/flux.gguf"


def test_a_comfyui_fp8_file_under_the_full_checkpoint_prefix_loads(
        files: dict[str, Path], tiny_model_dir: Path, tmp_path: Path) -> None:
    """ComfyUI's full checkpoints put everything, the ``scaled_fp8`` marker too, under
    ``model.diffusion_model.``; the marker was then taken for a tensor the model lacks."""
    import torch
    from safetensors.torch import load_file, save_file

    from ditserve.engine.weights.dit_file import load_dit_file

    state = load_file(str(files["fp8"]))
    assert "scaled_fp8" in state  # the marker our FP8 files carry, as ComfyUI's
    prefixed = tmp_path / "comfy-full.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, str(prefixed))
    assert check_checkpoint(prefixed, tiny_model_dir).family == "flux"
    bare = load_dit_file(files["fp8"], tiny_model_dir, dtype="float32").state_dict()
    full = load_dit_file(prefixed, tiny_model_dir, dtype="float32").state_dict()
    assert bare.keys() == full.keys()
    assert all(torch.equal(bare[k], full[k]) for k in bare)
