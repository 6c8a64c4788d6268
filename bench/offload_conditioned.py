#!/usr/bin/env python3
"""Layerwise offload for the image-conditioned DiTs on one GPU: resident vs ditserve DLO vs
diffusers group offloading, as bench/offload_families.py measures their text-only siblings
(the same runner, ``offload_methods.py``: methods, table and JSON; this file adds the models
and the targets).

- ``--model qwen-image-edit``: Qwen-Image-Edit's DiT (Qwen-Image's 20.4B architecture, built
  by the family's own builder) at 1024x1024 with a 1024x1024 source: every row carries 4096
  target + 4096 source tokens, and 1433 text tokens (Qwen2.5-VL reads the source as 37x37 =
  1369 vision tokens, plus a short prompt); batches 1 and 4;
- ``--model wan-i2v``: Wan2.1-I2V-14B-480P's DiT (36 input channels, CLIP image context of
  257 tokens 1280 wide) at 832x480, 81 frames, batch 1 (CFG's two rows: ``--batches 2``).

Target (issue 36): DLO ms/step <= 1.02 x max(PCIe floor, resident), the PCIe floor being
streamed bytes / measured pinned H2D rate.

    python3 bench/offload_conditioned.py --model qwen-image-edit --out out/cond-qwen-edit
    python3 bench/offload_conditioned.py --model wan-i2v --out out/cond-wan-i2v

``--tiny`` runs it on tiny DiTs on a CPU (a smoke test; tests run it).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import offload_methods
import torch
from offload_methods import find, target

from ditserve.engine.families.wan.block import chunk_token_math
from ditserve.engine.makers.builders import make_dit

MODELS_NAMES = ("qwen-image-edit", "wan-i2v")
DEFAULT_SIZES = {"qwen-image-edit": "1024x1024", "wan-i2v": "832x480x81"}
TINY_SIZES = {"qwen-image-edit": "64x64", "wan-i2v": "64x64x5"}
DEFAULT_BATCHES = {"qwen-image-edit": (1, 4), "wan-i2v": (1,)}
DEFAULT_ITERS = {"qwen-image-edit": 3, "wan-i2v": 2}
# Qwen-Image-Edit's text rows: a 1024x1024 source read by Qwen2.5-VL (1036 px / 28 = 37 vision
# tokens a side) and a prompt of 64 tokens.
QWEN_TEXT_TOKENS, WAN_TEXT_TOKENS, CLIP_TOKENS = 37 * 37 + 64, 512, 257


def build_dit(model: str, size: str, device: torch.device, seed: int,
              stock_blocks: bool = False) -> torch.nn.Module:
    variant = model  # the family's own variant: qwen-image-edit, wan-i2v
    dit: torch.nn.Module = make_dit(variant, size, dtype=torch.bfloat16, device=device,
                                    seed=seed)
    if variant == "wan-i2v" and not stock_blocks:
        chunk_token_math(dit)
    return dit


def workloads(model: str, size: str, batches: tuple[int, ...], dit: torch.nn.Module,
              device: torch.device) -> list[tuple[str, Callable[[], Any]]]:
    g = torch.Generator(device=device).manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)

    config: Any = dit.config
    dims = [int(x) for x in size.split("x")]
    out: list[tuple[str, Callable[[], Any]]] = []
    for b in batches:
        if model == "qwen-image-edit":
            width, height = dims
            h, w = height // 16, width // 16  # 8x VAE, then 2x2 packing
            # (b, target + source tokens, C): the source's tokens follow the target's.
            kw: dict[str, Any] = dict(
                hidden_states=randn(b, 2 * h * w, config.in_channels),
                encoder_hidden_states=randn(b, QWEN_TEXT_TOKENS, config.joint_attention_dim),
                timestep=torch.full((b,), 0.5, device=device, dtype=torch.bfloat16),
                img_shapes=[[(1, h, w), (1, h, w)]] * b, return_dict=False)
        else:
            width, height, frames = dims
            latent = ((frames - 1) // 4 + 1, height // 8, width // 8)
            kw = dict(hidden_states=randn(b, config.in_channels, *latent),
                      encoder_hidden_states=randn(b, WAN_TEXT_TOKENS, config.text_dim),
                      encoder_hidden_states_image=randn(b, CLIP_TOKENS, config.image_dim),
                      timestep=torch.full((b,), 500.0, device=device), return_dict=False)
        out.append((f"b{b}", lambda kw=kw: dit(**kw)))
    return out


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Per cell: DLO within 2% of the larger of the PCIe floor and the resident step."""
    dlo = r["methods"].get("dlo", {}).get("report")
    gbps = r.get("h2d_gbps")
    if not dlo:
        return []
    out = []
    for label in sorted({c["cell"] for c in r["cells"]}):
        d, res = find(r, "dlo", label), find(r, "resident", label)
        if not d or not res:
            continue
        floor = dlo["streamed_bytes"] / (gbps * 1e9) * 1e3 if gbps else 0.0
        out.append(target(f"DLO {label} <= 1.02 x max(PCIe floor {floor:.0f} ms, resident "
                          f"{res['ms']:.0f} ms)", d["ms"], 1.02 * max(floor, res["ms"]), "ms"))
    return out


MODELS = offload_methods.Models(build_dit=build_dit, workloads=workloads, targets=targets)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    offload_methods.add_arguments(p, models=MODELS_NAMES, out="out/offload-conditioned",
                                  methods=("resident", "dlo", "diffusers-block"))
    args = p.parse_args(argv)
    args.size = args.size or (TINY_SIZES if args.tiny else DEFAULT_SIZES)[args.model]
    args.batches = args.batches or list(DEFAULT_BATCHES[args.model])
    args.iters = args.iters or DEFAULT_ITERS[args.model]
    return offload_methods.run("offload_conditioned.py", args, MODELS)


if __name__ == "__main__":
    sys.exit(main())
