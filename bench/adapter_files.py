"""Random LoRA files for a served model's DiT, for the serving benchmarks' adapter workload
(``bench/serving.py --mixed --mixed-configs dlo+lora:4``; issue 45, item 13).

The DiT is built from its ``transformer/config.json`` on the meta device (no weights read or
allocated: a full-size Flux takes a second), and each adapter's factors are drawn to fit its
linear layers. Adapters 0..n-2 are PEFT files (``transformer.<module>.lora_A/B.weight``) on
the attention projections (image and text), the feed-forward outputs and the single blocks'
MLP input; the last one is a kohya / ComfyUI Flux file (``lora_unet_*`` with
``lora_down``/``lora_up``/``alpha``, BFL module names), converted at load by diffusers as a
user's file is. Values are small (std 0.01): throughput, not pictures, is measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

PEFT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                "to_add_out", "ff.net.2", "ff_context.net.2", "proj_mlp")
STD = 0.01


def meta_dit(model_dir: str | Path) -> nn.Module:
    """The model's DiT with its real shapes and no storage."""
    import diffusers

    config = json.loads((Path(model_dir) / "transformer" / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    with torch.device("meta"):
        return cls.from_config(config)


def _draw(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(shape, generator=generator) * STD).to(torch.bfloat16)


def peft_file(dit: nn.Module, path: Path, *, rank: int, seed: int) -> Path:
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, module in dit.named_modules():
        if not isinstance(module, nn.Linear) or not any(
                name == t or name.endswith("." + t) for t in PEFT_TARGETS):
            continue
        tensors[f"transformer.{name}.lora_A.weight"] = _draw((rank, module.in_features), generator)
        tensors[f"transformer.{name}.lora_B.weight"] = _draw((module.out_features, rank), generator)
    if not tensors:
        raise SystemExit(f"no linear layer of {type(dit).__name__} matches {PEFT_TARGETS}")
    save_file(tensors, str(path))
    return path


def kohya_flux_file(dit: nn.Module, path: Path, *, rank: int, seed: int) -> Path:
    """BFL names: each double block's fused qkv and projection (image and text), each single
    block's output linear (linear2); linear1 is left out, as diffusers' converter splits it
    by Flux.1's full-size widths and a tiny model has others."""
    config = dit.config
    inner = int(config.num_attention_heads) * int(config.attention_head_dim)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}

    def pair(key: str, fan_in: int, fan_out: int) -> None:
        tensors[f"lora_unet_{key}.lora_down.weight"] = _draw((rank, fan_in), generator)
        tensors[f"lora_unet_{key}.lora_up.weight"] = _draw((fan_out, rank), generator)
        tensors[f"lora_unet_{key}.alpha"] = torch.tensor(float(rank))

    for i in range(int(config.num_layers)):
        for side in ("img", "txt"):
            pair(f"double_blocks_{i}_{side}_attn_qkv", inner, 3 * inner)
            pair(f"double_blocks_{i}_{side}_attn_proj", inner, inner)
    for i in range(int(config.num_single_layers)):
        pair(f"single_blocks_{i}_linear2", inner + 4 * inner, inner)
    save_file(tensors, str(path))
    return path


def write_adapters(model_dir: str | Path, out_dir: str | Path, ranks: list[int], *,
                   prefix: str = "bench-lora") -> dict[str, Path]:
    """One file per rank in ``out_dir``, named ``<prefix><i>``; the last one kohya when the
    DiT is a Flux.1 one (others: all PEFT). Returns name -> file."""
    dit = meta_dit(model_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kohya = type(dit).__name__ == "FluxTransformer2DModel"
    files = {}
    for i, rank in enumerate(ranks):
        name, path = f"{prefix}{i}", out / f"{prefix}{i}.safetensors"
        if kohya and i == len(ranks) - 1 and len(ranks) > 1:
            files[name] = kohya_flux_file(dit, path, rank=rank, seed=i)
        else:
            files[name] = peft_file(dit, path, rank=rank, seed=i)
    return files
