"""Model directories for the checkpoint-file tests: the tiny Flux pipeline with a DiT whose
linear widths are multiples of 256, so GGUF's K-quants (256-value blocks) quantize every block
linear (the default tiny DiT is 32 wide: only Q8_0's 32-value blocks fit it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

WIDE_DIT = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                attention_head_dim=128, num_attention_heads=2, joint_attention_dim=32,
                pooled_projection_dim=32, axes_dims_rope=(16, 56, 56), guidance_embeds=True)


def wide_flux(tiny_model_dir: Path, dst: Path) -> Path:
    """A copy of the tiny pipeline at ``dst`` with a 256-wide random DiT (float32)."""
    from diffusers import FluxTransformer2DModel

    shutil.copytree(tiny_model_dir, dst)
    shutil.rmtree(dst / "transformer")
    torch.manual_seed(3)
    model = FluxTransformer2DModel(**WIDE_DIT)
    with torch.no_grad():  # weights of a trained model's scale, so the image depends on them
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(dst / "transformer")
    return dst


# A tiny Wan DiT 64 wide (2 heads of 32) with a 64-wide FFN: its block linears have 4096
# values, so GGUF Q8_0 quantizes them (the default tiny Wan is 24 wide: no 32-value row blocks).
WIDE_WAN = dict(attention_head_dim=32, ffn_dim=64)
# A tiny Wan DiT 256 wide (2 heads of 128) with a 256-wide FFN: every block linear's rows are a
# multiple of 256, so GGUF's K-quants (Q4_K: 256-value blocks) quantize them all. Its text and
# time embedders' first linears take 32 inputs (the tiny text encoder's width, ``freq_dim``):
# those stay F16 in a Q4_K file, as in a Flux one.
K_QUANT_WAN = dict(attention_head_dim=128, ffn_dim=256)


def wide_wan(tiny_wan_dir: Path, dst: Path, widths: dict[str, int] | None = None) -> Path:
    """A copy of the tiny Wan pipeline (any variant: T2V, I2V, TI2V) at ``dst`` with a wider
    random DiT (float32): ``widths`` (default ``WIDE_WAN``) replace its config's."""
    from diffusers import WanTransformer3DModel

    shutil.copytree(tiny_wan_dir, dst)
    config = dict(WanTransformer3DModel.load_config(str(tiny_wan_dir), subfolder="transformer"))
    config.update(widths or WIDE_WAN)
    if config.get("added_kv_proj_dim") is not None:
        # image-to-video's image keys and values project the embedded image tokens, which are
        # as wide as the model
        config["added_kv_proj_dim"] = config["num_attention_heads"] * config["attention_head_dim"]
    shutil.rmtree(dst / "transformer")
    torch.manual_seed(4)
    model = WanTransformer3DModel.from_config(config)
    with torch.no_grad():  # weights of a trained model's scale, so the video depends on them
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(dst / "transformer")
    return dst


# 256-wide tiny DiTs of FLUX.2 and Z-Image (2 heads of 128), so Q4_K's 256-value rows fit
# their block linears (the tiny ones are 32 wide). Z-Image's FFN is int(dim / 3 * 8) = 682
# wide: its ``w2`` (682 inputs) stays F16 in a Q4_K file, every other block linear quantizes.
K_QUANT_DITS: dict[str, dict[str, object]] = {
    "flux2": dict(attention_head_dim=128, num_attention_heads=2, axes_dims_rope=(32, 32, 32, 32)),
    "z-image": dict(dim=256, n_heads=2, n_kv_heads=2, axes_dims=[32, 48, 48]),
}


def widened(tiny_dir: Path, dst: Path, widths: dict[str, object]) -> Path:
    """A copy of a tiny pipeline at ``dst`` whose DiT's config takes ``widths``, random
    weights of a trained model's scale (float32). The DiT class is the folder's own."""
    import json

    import diffusers

    shutil.copytree(tiny_dir, dst)
    config = json.loads((tiny_dir / "transformer" / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    config = dict(cls.load_config(str(tiny_dir), subfolder="transformer"))
    config.update(widths)
    shutil.rmtree(dst / "transformer")
    torch.manual_seed(5)
    model = cls.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(dst / "transformer")
    return dst


def align_folder_dits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make a folder's DiT load give each tensor an allocation of its own (64-byte aligned),
    as a checkpoint file's load does (``dit_file._own_storage``). A tiny folder's own load
    (Wan's, Z-Image's) leaves its tensors 8-byte aligned (where each lies after safetensors'
    header), and
    CPU matmul kernels take another path for such pointers: outputs differ in the last bits
    (within 1e-5 here), whatever the weights."""
    from ditserve.engine.weights import load
    from ditserve.engine.weights.loader import DIT_COMPONENT, load_dit

    ordinary = load.load_components

    def aligned(model_dir: Path, *, dtype: str, dits: object = None) -> object:
        if dits is None:
            dit = load_dit(model_dir, dtype=dtype)
            for tensor in dit.parameters():
                tensor.data = tensor.data.clone()
            dits = {DIT_COMPONENT: dit}
        return ordinary(model_dir, dtype=dtype, dits=dits)

    monkeypatch.setattr(load, "load_components", aligned)
