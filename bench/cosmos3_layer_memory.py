#!/usr/bin/env python3
"""How much memory one Cosmos3 decoder layer's forward holds at once, Nano against the
Super-sized DiT, counted on the ``meta`` device (no GPU, no weights: seconds on a laptop).

The offload benchmark's memory target (``offload_families.py --model cosmos3-super
--baseline-model cosmos3``) compares peak HBM, which under DLO is two block slots, the
resident modules and the activations of one layer's forward at the step's token count
(1280x720x189 with CFG: two sequences of ~200 prompt tokens and 48 x 23 x 40 = 44160 vision
tokens). The activations are the model's, not the offload's: this program counts them, op by
op, for both DiTs as the engine runs them (the packed-items attention processor, sliced
feed-forwards and rotary embedding, FP8 linears as ``torch._scaled_mm`` allocates them:
the per-token activation quantization, then a bf16 output), and prints the peak above the
layer's input with the op where it is reached - so a measured growth can be split into the
slots' and the activations' shares.

``live_bytes.LiveBytes`` sees every op's outputs; a new tensor (not a view, not an in-place op's
result) adds its bytes while alive. The attention kernel is counted as flash attention's: its
output only (its working set is a few MiB). The allocator's rounding and
the cuBLAS workspace are not counted, so a GPU's number is somewhat higher.

    python3 bench/cosmos3_layer_memory.py            # Nano and Super at 1280x720x189, CFG
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace
from typing import Any

import torch
from live_bytes import LiveBytes, track_modules
from torch import nn

from ditserve.engine.families.cosmos3 import packing
from ditserve.engine.families.cosmos3.block import chunk_token_math
from ditserve.engine.formats.fp8_quant import quantize_activation
from ditserve.engine.makers.builders import dit_class, dit_config

GIB = 2**30
PROMPT_TOKENS = (210, 190)  # as bench/cosmos3_inputs.py


class ScaledMMLinear(nn.Module):
    """A linear as the FP8 path allocates on CUDA: the activation quantized per token (its
    temporaries), then ``torch._scaled_mm``'s bf16 output beside the fp8 copy."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp8, scale = quantize_activation(x.reshape(-1, x.shape[-1]))
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=torch.bfloat16,
                          device=x.device)
        del x_fp8, scale
        return out


def fp8_linears(module: nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, ScaledMMLinear(child))
        else:
            fp8_linears(child)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **_: Any
                    ) -> torch.Tensor:
    return torch.empty_like(q)


def layer_peak(variant: str, vision_tokens: int, fp8: bool) -> tuple[float, float, str]:
    """(input GiB, peak GiB above the input, the op at the peak) of one layer's forward."""
    config = dict(dit_config(variant, "full"), num_hidden_layers=1)
    with torch.device("meta"):
        dit = dit_class(variant)(**config).to(torch.bfloat16)
    dit.set_attn_processor(packing.PackedItemsProcessor())
    chunk_token_math(dit)
    layer = dit.layers[0]
    if fp8:
        fp8_linears(layer)
    width, head_dim = int(dit.config.hidden_size), int(dit.config.head_dim)
    und_len, gen_len = sum(PROMPT_TOKENS), len(PROMPT_TOKENS) * vision_tokens

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    und, gen = meta(und_len, width), meta(gen_len, width)
    rotary = (meta(und_len, head_dim), meta(und_len, head_dim), meta(gen_len, head_dim),
              meta(gen_len, head_dim))
    import diffusers.models.attention_dispatch as dispatch

    real = dispatch.dispatch_attention_fn
    dispatch.dispatch_attention_fn = flash_attention
    # The attention processor reads only the items' lengths.
    items = [SimpleNamespace(layout=SimpleNamespace(und_len=n, gen_len=vision_tokens))
             for n in PROMPT_TOKENS]
    counted = LiveBytes()
    track_modules(layer, counted, root="layer")
    try:
        with packing.items_in_flight(items), torch.no_grad(), counted:  # no autograd graph
            out = layer(und, gen, rotary)
        del out
    finally:
        dispatch.dispatch_attention_fn = real
    inputs = sum(t.untyped_storage().nbytes() for t in (und, gen, *rotary))
    return inputs / GIB, counted.peak / GIB, counted.peak_op


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="1280x720x189", help="WIDTHxHEIGHTxFRAMES")
    p.add_argument("--variants", nargs="+", default=["cosmos3", "cosmos3-super"])
    p.add_argument("--bf16", action="store_true", help="bf16 linears instead of FP8")
    args = p.parse_args(argv)
    width, height, frames = (int(x) for x in args.size.split("x"))
    grid = ((frames - 1) // 4 + 1, -(-height // 32), -(-width // 32))  # 16x VAE, 2x2 patches
    vision = grid[0] * grid[1] * grid[2]
    print(f"{args.size}, CFG: 2 x ({vision} vision tokens after ~200 prompt tokens); "
          f"{'bf16' if args.bf16 else 'FP8'} linears")
    print("| DiT | layer input GiB | peak above input GiB | op at the peak |")
    print("|---|---|---|---|")
    for variant in args.variants:
        inputs, peak, op = layer_peak(variant, vision, fp8=not args.bf16)
        print(f"| {variant} | {inputs:.2f} | {peak:.2f} | {op} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
