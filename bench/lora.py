#!/usr/bin/env python3
"""Per-request LoRA adapters on one GPU: a step of 4 requests with 4 different adapters
against the same step without adapters, and against the seed design (one pass per adapter).

A random full-size Flux DiT (bf16, built on the GPU; nothing written to disk), 1024x1024
(4096 image tokens, 512 text tokens per row), every block's linear layers adapted by 4
random rank-64 adapters (attention q/k/v/out, the context projections, the feed-forwards and
the single blocks' MLP and output: what Flux LoRAs train) through the engine's own hooks
(``engine.adapters``). Cells, each for ``resident`` (the whole DiT in HBM) and ``dlo``
(``enable_offload``, every block streamed):

- ``base b4``: one forward of 4 rows, no adapters;
- ``lora b4``: one forward of 4 rows, row i with adapter i (base matmul once for all rows,
  each adapter's low-rank delta on its own row);
- ``per-adapter 4x b1``: the seed design - the adapter is part of the batch key, so the 4
  requests run as 4 forwards of 1 row, each a full pass of the (streamed) weights.

Targets (issue 35): ``lora b4`` <= 1.10x ``base b4``, resident and DLO. Reports ms/step
(median of CUDA-event timings) and the adapters' device bytes; writes JSON and markdown.

    python3 -P bench/lora.py --out out/lora

``--tiny`` runs the same program on a tiny Flux DiT on a CPU (a smoke test; tests run it).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import offload_methods
import torch
from torch import nn

from ditserve.engine.adapters.files import LoraFactors
from ditserve.engine.adapters.linear import AdaptedLinear
from ditserve.engine.adapters.rows import RowAdapters, RowSegment, applying
from ditserve.engine.config import OffloadConfig
from ditserve.engine.families.flux import DIT_SIZES as FLUX_TRANSFORMER
from ditserve.engine.makers.builders import dit_class
from ditserve.engine.offload import enable_offload

TARGET = 1.10
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_dit(size: str, device: torch.device, dtype: torch.dtype) -> nn.Module:

    previous = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            dit = dit_class("flux")(**FLUX_TRANSFORMER[size])
    finally:
        torch.set_default_dtype(previous)
    return dit.eval()


def attach_adapters(dit: nn.Module, count: int, rank: int, dtype: torch.dtype,
                    device: torch.device) -> int:
    """``count`` random rank-``rank`` adapters on every linear inside the blocks; bytes."""
    g = torch.Generator(device=device).manual_seed(1)
    nbytes = 0
    for list_name in BLOCK_LISTS:
        for name, module in getattr(dit, list_name).named_modules():
            if not isinstance(module, nn.Linear) or name.endswith(("norm.linear", "norm1.linear",
                                                                   "norm1_context.linear")):
                continue  # modulation linears take (rows, dim): LoRAs rarely train them
            layer = AdaptedLinear(f"{list_name}.{name}", module)
            for key in range(count):
                down = torch.randn(rank, module.in_features, generator=g, device=device,
                                   dtype=dtype) * 0.01
                up = torch.randn(module.out_features, rank, generator=g, device=device,
                                 dtype=dtype) * 0.01
                factors = LoraFactors(down=down, up=up, scaling=1.0)
                layer.add((f"adapter{key}", 0), factors)
                nbytes += factors.nbytes
    return nbytes


def inputs(dit: nn.Module, rows: int, side: int, text: int, device: torch.device,
           dtype: torch.dtype) -> dict[str, Any]:
    config = dit.config
    tokens = (side // 16) ** 2
    g = torch.Generator(device=device).manual_seed(2)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    return dict(hidden_states=randn(rows, tokens, config.in_channels),
                encoder_hidden_states=randn(rows, text, config.joint_attention_dim),
                pooled_projections=randn(rows, config.pooled_projection_dim),
                timestep=torch.full((rows,), 0.5, device=device, dtype=dtype),
                guidance=torch.full((rows,), 3.5, device=device, dtype=dtype)
                if config.guidance_embeds else None,
                img_ids=torch.zeros(tokens, 3, device=device, dtype=dtype),
                txt_ids=torch.zeros(text, 3, device=device, dtype=dtype), return_dict=False)


def cells(dit: nn.Module, args: argparse.Namespace, device: torch.device,
          dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    n = args.requests
    batch = inputs(dit, n, args.side, args.text_tokens, device, dtype)
    single = inputs(dit, 1, args.side, args.text_tokens, device, dtype)
    mixed = RowAdapters(n, tuple(RowSegment(i, i + 1, (((f"adapter{i}", 0), 1.0),))
                                 for i in range(n)))

    def base() -> Any:
        return dit(**batch)

    def lora() -> Any:
        with applying(mixed):
            return dit(**batch)

    def per_adapter() -> Any:
        for i in range(n):
            with applying(RowAdapters(1, (RowSegment(0, 1, (((f"adapter{i}", 0), 1.0),)),))):
                dit(**single)

    return {f"base b{n}": base, f"lora b{n}": lora, f"per-adapter {n}x b1": per_adapter}


def time_steps(step: Callable[[], Any], warmup: int, iters: int) -> float:
    """Median ms per step (CUDA events on a GPU, wall clock on a CPU)."""
    with torch.inference_mode():
        return statistics.median(offload_methods.time_steps(step, warmup, iters))


def run_method(method: str, args: argparse.Namespace, device: torch.device,
               dtype: torch.dtype) -> dict[str, Any]:
    dit = build_dit(args.size, device, dtype)
    nbytes = attach_adapters(dit, args.requests, args.rank, dtype, device)
    handle = None
    if method == "dlo":
        handle = enable_offload(dit, OffloadConfig(enabled=True), device=device)
    out: dict[str, Any] = {"adapter_bytes": nbytes, "ms": {}}
    for label, step in cells(dit, args, device, dtype).items():
        out["ms"][label] = time_steps(step, args.warmup, args.iters)
        log(f"{method:8s} {label:18s} {out['ms'][label]:9.1f} ms/step")
    if handle is not None:
        handle.disable()
    del dit
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def table(results: dict[str, Any], n: int) -> str:
    lines = [f"| method | base b{n} ms | lora b{n} ms | per-adapter {n}x b1 ms | lora / base | "
             "per-adapter / lora | target lora/base <= 1.10 |",
             "|---|---|---|---|---|---|---|"]
    for method, r in results["methods"].items():
        ms = r["ms"]
        base, lora, seed = ms[f"base b{n}"], ms[f"lora b{n}"], ms[f"per-adapter {n}x b1"]
        ok = "yes" if lora / base <= TARGET else "NO"
        lines.append(f"| {method} | {base:.1f} | {lora:.1f} | {seed:.1f} | {lora / base:.3f} "
                     f"| {seed / lora:.2f} | {ok if not results['tiny'] else 'not judged'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny DiT on the CPU (smoke test)")
    p.add_argument("--methods", nargs="+", default=["resident", "dlo"],
                   choices=["resident", "dlo"])
    p.add_argument("--requests", type=int, default=4, help="rows, one adapter each")
    p.add_argument("--rank", type=int, default=None, help="adapter rank (default 64)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("out/lora"))
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    args.size, args.side = ("tiny", 64) if args.tiny else ("full", 1024)
    args.text_tokens = 16 if args.tiny else 512
    args.rank = args.rank or (4 if args.tiny else 64)
    args.iters = args.iters or (2 if args.tiny else 5)
    args.warmup = 1
    results: dict[str, Any] = {
        "tiny": args.tiny, "device": torch.cuda.get_device_name() if device.type == "cuda"
        else "cpu", "torch": torch.__version__, "python": platform.python_version(),
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rank": args.rank, "requests": args.requests, "size": f"{args.side}x{args.side}",
        "methods": {}}
    for method in args.methods:
        results["methods"][method] = run_method(method, args, device, dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora.json").write_text(json.dumps(results, indent=1))
    text = table(results, args.requests)
    (args.out / "lora.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
