"""Model directories for the checkpoint-file tests: the tiny Flux pipeline with a DiT whose
linear widths are multiples of 256, so GGUF's K-quants (256-value blocks) quantize every block
linear (the default tiny DiT is 32 wide: only Q8_0's 32-value blocks fit it)."""

from __future__ import annotations

import shutil
from pathlib import Path

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
