"""Small random LoRA files for the adapter tests: PEFT-format safetensors with the module
names diffusers expects (``transformer.<module>.lora_A/B.weight``), and a kohya-format Flux
file (``lora_unet_*`` keys with ``lora_down``/``lora_up`` and ``alpha``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")


def peft_lora(transformer: nn.Module, path: Path, *, rank: int, seed: int,
              targets: Sequence[str] = ATTENTION, std: float = 0.2) -> Path:
    """A PEFT-layout file adapting every linear whose name ends with one of ``targets``."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in transformer.named_modules():
        if not isinstance(module, nn.Linear) or not any(
                name == t or name.endswith("." + t) for t in targets):
            continue
        tensors[f"transformer.{name}.lora_A.weight"] = torch.randn(
            rank, module.in_features, generator=generator) * std
        tensors[f"transformer.{name}.lora_B.weight"] = torch.randn(
            module.out_features, rank, generator=generator) * std
    assert tensors, f"no linear matches {targets}"
    save_file(tensors, str(path))
    return path


def kohya_flux_lora(transformer: nn.Module, path: Path, *, rank: int, alpha: float,
                    seed: int, std: float = 0.2) -> Path:
    """A kohya / ComfyUI Flux file: BFL module names (fused qkv, linear1/linear2)."""
    config = transformer.config
    inner = int(config.num_attention_heads) * int(config.attention_head_dim)
    mlp = 4 * inner
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def pair(key: str, fan_in: int, fan_out: int) -> None:
        tensors[f"lora_unet_{key}.lora_down.weight"] = torch.randn(
            rank, fan_in, generator=generator) * std
        tensors[f"lora_unet_{key}.lora_up.weight"] = torch.randn(
            fan_out, rank, generator=generator) * std
        tensors[f"lora_unet_{key}.alpha"] = torch.tensor(float(alpha))

    for i in range(int(config.num_layers)):
        for side in ("img", "txt"):
            pair(f"double_blocks_{i}_{side}_attn_qkv", inner, 3 * inner)
            pair(f"double_blocks_{i}_{side}_attn_proj", inner, inner)
    for i in range(int(config.num_single_layers)):
        # linear1 (fused q, k, v, mlp) is left out: diffusers' kohya converter splits it by
        # Flux.1's full-size widths, which a tiny model does not have.
        pair(f"single_blocks_{i}_linear2", inner + mlp, inner)
    save_file(tensors, str(path))
    return path
