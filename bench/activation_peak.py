#!/usr/bin/env python3
"""Where a video DiT's HBM goes besides its weights: peak activation memory of one Wan block
and of the VAE decode, per number of rows.

DLO streams the weights through two block slots, so at batch > 1 a served video model's HBM
is mostly what one block's forward holds at once. This program builds a one-block random
Wan's DiT at the Wan2.1-T2V-14B widths (diffusers' defaults: dim 5120, FFN
13824, 40 heads) and the Wan2.1 VAE, both bf16 on the GPU, and for each ``--rows`` (a CFG
job is two rows) reports the allocator's peak above the weights: the whole forward, and
within its self-attention, cross-attention and feed-forward (each measured from its own
entry, so the three show which sub-layer sets the peak); then one video's VAE decode. Every
number is ``torch.cuda.max_memory_allocated`` minus the allocation before the call. Each
forward runs three times: with diffusers' block forward (the sub-layer columns), with the
float32 token-wise math in slices (``chunk_token_math(..., ffn_chunk_rows=None)``, whose
output must be bit-identical) and with the engine's default, the feed-forward in slices too
(its largest difference from diffusers' output is printed).

    python3 bench/activation_peak.py --size 832x480 --frames 33 --rows 2 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

GIB = 2**30


def peak_during(fn, *args, **kwargs) -> tuple[float, object]:
    """GiB the allocator peaked at above its allocation before ``fn(*args, **kwargs)``."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*args, **kwargs)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / GIB, out


def sublayer_peaks(block: torch.nn.Module) -> dict[str, float]:
    """Hooks recording the peak above entry of each named sub-layer of a Wan block."""
    peaks: dict[str, float] = {}
    entry: dict[str, int] = {}

    def pre(name):
        def hook(_module, _args):
            torch.cuda.synchronize()
            entry[name] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        return hook

    def post(name):
        def hook(_module, _args, _out):
            torch.cuda.synchronize()
            peaks[name] = (torch.cuda.max_memory_allocated() - entry[name]) / GIB
        return hook

    for name in ("attn1", "attn2", "ffn"):
        module = getattr(block, name)
        module.register_forward_pre_hook(pre(name))
        module.register_forward_hook(post(name))
    return peaks


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="832x480", help="WxH in pixels")
    p.add_argument("--frames", type=int, default=33)
    p.add_argument("--rows", type=int, nargs="+", default=[2, 8])
    p.add_argument("--out", default=None, help="write the table as JSON here")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from diffusers import AutoencoderKLWan

    from ditserve.engine.families.wan.block import chunk_token_math
    from ditserve.engine.makers.builders import dit_class

    width, height = (int(v) for v in a.size.split("x"))
    latent_frames = (a.frames - 1) // 4 + 1
    lh, lw = height // 8, width // 8
    tokens = latent_frames * (lh // 2) * (lw // 2)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    dit = dit_class("wan")(num_layers=1).to(dev, torch.bfloat16).eval()
    peaks = sublayer_peaks(dit.blocks[0])
    rows_out = []
    for rows in a.rows:
        latents = torch.randn(rows, 16, latent_frames, lh, lw, device=dev, dtype=torch.bfloat16)
        text = torch.randn(rows, 512, 4096, device=dev, dtype=torch.bfloat16)
        t = torch.full((rows,), 500, device=dev, dtype=torch.long)
        with torch.inference_mode():
            dit.blocks[0].__dict__.pop("forward", None)  # diffusers' own block forward
            total, stock = peak_during(dit, latents, t, text, return_dict=False)
            stock_peaks = dict(peaks)
            chunk_token_math(dit, ffn_chunk_rows=None)  # token-wise float32 math in slices
            sliced_total, sliced = peak_during(dit, latents, t, text, return_dict=False)
            chunk_token_math(dit)  # the engine's default: the feed-forward in slices too
            ffn_total, ffn = peak_during(dit, latents, t, text, return_dict=False)
        hidden = rows * tokens * 5120 * 2 / GIB  # one bf16 hidden-state tensor
        rows_out.append({"rows": rows, "tokens": rows * tokens, "forward_gib": total,
                         "sliced_forward_gib": sliced_total,
                         "sliced_identical": bool(torch.equal(stock[0], sliced[0])),
                         "sliced_ffn_forward_gib": ffn_total,
                         "sliced_ffn_max_abs_diff": float((ffn[0].float() - stock[0].float()).abs().max()),
                         "hidden_gib": hidden, **{f"{k}_gib": v for k, v in stock_peaks.items()}})
        del latents, text, stock, sliced, ffn
    del dit
    torch.cuda.empty_cache()
    vae = AutoencoderKLWan().to(dev, torch.bfloat16).eval()
    z = torch.randn(1, 16, latent_frames, lh, lw, device=dev, dtype=torch.bfloat16)
    with torch.inference_mode():
        decode, _ = peak_during(vae.decode, z, return_dict=False)

    print(f"Wan2.1-14B widths, {a.size} x {a.frames} frames: {tokens} tokens per row; "
          f"GiB above the weights")
    print(f"{'rows':>5} {'tokens':>8} {'hidden':>7} {'forward':>8} {'attn1':>7} {'attn2':>7} "
          f"{'ffn':>7} {'fwd/hidden':>10} {'sliced':>7} {'sl/hidden':>9} {'identical':>9} "
          f"{'+ffn':>7} {'+ffn/hid':>8} {'max diff':>9}")
    for r in rows_out:
        print(f"{r['rows']:>5} {r['tokens']:>8} {r['hidden_gib']:>7.2f} {r['forward_gib']:>8.2f} "
              f"{r['attn1_gib']:>7.2f} {r['attn2_gib']:>7.2f} {r['ffn_gib']:>7.2f} "
              f"{r['forward_gib'] / r['hidden_gib']:>10.1f} {r['sliced_forward_gib']:>7.2f} "
              f"{r['sliced_forward_gib'] / r['hidden_gib']:>9.1f} {str(r['sliced_identical']):>9} "
              f"{r['sliced_ffn_forward_gib']:>7.2f} "
              f"{r['sliced_ffn_forward_gib'] / r['hidden_gib']:>8.1f} "
              f"{r['sliced_ffn_max_abs_diff']:>9.2e}")
    print(f"VAE decode of one video: {decode:.2f} GiB")
    if a.out:
        Path(a.out).write_text(json.dumps({"size": a.size, "frames": a.frames, "tokens_per_row": tokens,
                                           "rows": rows_out, "vae_decode_gib": decode}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
