#!/usr/bin/env python3
"""Lossless packed bf16: encode MB/s (CPU), packed ratio, escape rate, decode GB/s.

Two weight sources, each one flat bf16 run per streamed block (as DLO packs a block's bf16
region):

- ``random-init``: real diffusers Flux blocks (one double-stream ``FluxTransformerBlock`` and
  one ``FluxSingleTransformerBlock``, Flux.1 widths unless ``--smoke``) with diffusers' own
  initialization - the weights every random-model benchmark streams;
- ``synthetic-trained``: the same tensor shapes filled with a made-up stand-in for trained
  weights (per-tensor scales spread log-normally around 0.02, Student-t tails, norm weights
  near 1, small biases). It is NOT a trained checkpoint; it only probes the escape path
  under wider exponent spreads than random init has.

For each: CPU encode MB/s (of bf16 input; all threads, and one), packed/bf16 bytes, escapes per value, CPU decode
MB/s, a bit-exact check, and with CUDA: the encode's GB/s with the block on the device (packed
bytes land in pinned host memory), the Triton decode's GB/s of bf16 output (CUDA events,
median of ``--iters``) and, for scale, the pinned H2D copy time of the packed vs the raw
bytes (what DLO moves per block).

    python3 bench/codec.py                  # one H200: Flux-width blocks, CPU encode + GPU decode
    python3 bench/codec.py --smoke          # CPU only, small blocks (CI runs this)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ditserve.engine.formats.packed_decode import decode, decode_into
from ditserve.engine.formats.packed_encode import encode

FLUX_WIDTH = dict(dim=3072, num_attention_heads=24, attention_head_dim=128)
SMOKE_WIDTH = dict(dim=128, num_attention_heads=2, attention_head_dim=64)


def log(msg: str) -> None:
    print(msg, flush=True)


def flux_blocks(width: dict[str, int], seed: int) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Named bf16 tensors of one double- and one single-stream Flux block, diffusers init."""
    from diffusers.models.transformers.transformer_flux import (
        FluxSingleTransformerBlock,
        FluxTransformerBlock,
    )

    torch.manual_seed(seed)
    blocks = {"double": FluxTransformerBlock(**width), "single": FluxSingleTransformerBlock(**width)}
    return {name: [(n, t.detach().to(torch.bfloat16)) for n, t in
                   list(block.named_parameters()) + list(block.named_buffers())]
            for name, block in blocks.items()}


def synthetic_trained(tensors: list[tuple[str, torch.Tensor]], seed: int) -> list[
        tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, t in tensors:
        if "norm" in name and t.dim() == 1:  # RMSNorm / LayerNorm weights sit near 1
            values = 1 + 0.1 * torch.randn(t.shape, generator=g)
        else:
            std = 0.02 * float(torch.exp(0.7 * torch.randn((), generator=g)))
            if name.endswith("bias"):
                std *= 0.1
            # Student-t (5 degrees of freedom): heavier tails than a Gaussian.
            normal = torch.randn(t.shape, generator=g)
            chi2 = torch.distributions.Chi2(5.0).sample(t.shape)
            values = std * normal / torch.sqrt(chi2 / 5.0)
        out.append((name, values.to(torch.bfloat16)))
    return out


def flat(tensors: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for _, t in tensors])


def cuda_ms(fn: Any, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(name: str, values: torch.Tensor, *, stripes: int, warmup: int, iters: int,
            gpu: bool) -> dict[str, Any]:
    mb = values.numel() * 2 / 1e6
    t0 = time.perf_counter()
    packed = encode(values, stripes=stripes)
    encode_s = time.perf_counter() - t0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per core: what a loader thread per block would get
    try:
        t0 = time.perf_counter()
        encode(values, stripes=stripes)
        encode_1t_s = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    back = decode(packed)
    decode_s = time.perf_counter() - t0
    row: dict[str, Any] = {
        "block": name, "values": values.numel(), "bf16_mb": round(mb, 2),
        "packed_mb": round(packed.layout.nbytes / 1e6, 2),
        "ratio": round(packed.layout.ratio, 5),
        "escapes_per_value": packed.layout.escapes / max(1, values.numel()),
        "encode_mb_s": round(mb / encode_s, 1), "encode_mb_s_1_thread": round(mb / encode_1t_s, 1),
        "cpu_decode_mb_s": round(mb / decode_s, 1),
        "exact": bool(torch.equal(back.view(torch.int16), values.view(torch.int16))),
    }
    if gpu:
        row.update(gpu_measure(packed, values, warmup=warmup, iters=iters))
    return row


def gpu_measure(packed: Any, values: torch.Tensor, *, warmup: int, iters: int) -> dict[str, Any]:
    device = torch.device("cuda")
    on_device = values.to(device)
    encode(on_device)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    encode(on_device, allocate=lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
    encode_s = time.perf_counter() - t0  # includes the packed bytes' copy back to the host
    on_gpu = packed.with_data(packed.data.to(device))
    out = torch.empty(values.numel(), dtype=torch.bfloat16, device=device)
    ms = cuda_ms(lambda: decode_into(on_gpu, out), warmup, iters)
    exact = torch.equal(out.cpu().view(torch.int16), values.view(torch.int16))
    raw_host = values.pin_memory()
    packed_host = packed.data.pin_memory()
    raw_dev = torch.empty_like(raw_host, device=device)
    packed_dev = torch.empty_like(packed_host, device=device)
    raw_ms = cuda_ms(lambda: raw_dev.copy_(raw_host, non_blocking=True), warmup, iters)
    packed_ms = cuda_ms(lambda: packed_dev.copy_(packed_host, non_blocking=True), warmup, iters)
    return {"gpu_encode_gb_s": round(values.numel() * 2 / encode_s / 1e9, 2),
            "gpu_decode_ms": round(ms, 3), "gpu_decode_gb_s": round(values.numel() * 2 / ms / 1e6, 1),
            "gpu_exact": bool(exact), "h2d_raw_ms": round(raw_ms, 3),
            "h2d_packed_ms": round(packed_ms, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU only, small blocks (CI)")
    p.add_argument("--stripes", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.smoke
    width = SMOKE_WIDTH if args.smoke else FLUX_WIDTH
    log(f"packed bf16 codec: {'smoke (CPU, small blocks)' if args.smoke else 'Flux.1 widths'}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
        f"GPU: {torch.cuda.get_device_name() if gpu else 'none'}")
    log("synthetic-trained weights are made up (not a checkpoint): read their escape rate as a "
        "stress case, not as what a trained model gives")
    rows = []
    for block, tensors in flux_blocks(width, args.seed).items():
        for source, named in (("random-init", tensors),
                              ("synthetic-trained", synthetic_trained(tensors, args.seed))):
            row = measure(f"{source}/{block}", flat(named), stripes=args.stripes,
                          warmup=args.warmup, iters=args.iters, gpu=gpu)
            rows.append(row)
    columns = ["block", "bf16_mb", "ratio", "escapes_per_value", "encode_mb_s",
               "encode_mb_s_1_thread",
               "cpu_decode_mb_s", "exact"]
    if gpu:
        columns += ["gpu_encode_gb_s", "gpu_decode_gb_s", "gpu_exact", "h2d_raw_ms", "h2d_packed_ms"]
    log(" | ".join(columns))
    for row in rows:
        log(" | ".join(f"{row[c]:.2e}" if c == "escapes_per_value" else str(row[c])
                       for c in columns))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["exact"] and r.get("gpu_exact", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
