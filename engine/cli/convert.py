"""`ditserve model convert SRC DST --to FORM`: a diffusers folder's DiT written as a checkpoint
file (single-file safetensors, GGUF, FP8) in the layouts other tools read.

A thin shell over ``engine.weights.convert``; ``model inspect FILE`` prints what the engine
would read from a file (format, family, stored types) without loading it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ditserve.engine.weights.checkpoint_file import CONVERT_TARGETS as TARGETS


def cmd_convert(args: argparse.Namespace) -> int:
    from ditserve.engine.weights.convert import convert

    report = convert(args.src, args.dst, to=args.to)
    # Two units: the file's tensors, and the model's linear layers quantized (a file may hold
    # several of those in one tensor: BFL's fused qkv is diffusers' to_q, to_k and to_v).
    print(f"wrote {report.path} ({args.to}): {report.tensors} tensors in the file, "
          f"{report.quantized} of the model's linear layers quantized, "
          f"{report.bytes / 2**20:.1f} MiB")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from ditserve.engine.weights.checkpoint_file import inspect_checkpoint

    info = inspect_checkpoint(args.file)
    types = ", ".join(f"{t} x{sum(1 for i in info.tensors.values() if i.dtype == t)}"
                      for t in info.quant_types)
    print(f"{info.path}: {info.format.value}, {info.family} DiT, {len(info.tensors)} tensors "
          f"({types})")
    return 0


def add_convert_parsers(model_sub: Any) -> None:
    """``model convert`` and ``model inspect`` under the ``model`` command's subparsers."""
    conv = model_sub.add_parser(
        "convert", help="write a diffusers folder's DiT as a single-file, GGUF or FP8 checkpoint")
    conv.add_argument("src", type=Path, help="a diffusers pipeline directory")
    conv.add_argument("dst", type=Path, help="the file to write (.safetensors or .gguf)")
    conv.add_argument("--to", required=True, choices=TARGETS,
                      help="single-file: safetensors in BFL key names (Flux), Wan's original "
                           "names (Wan) or diffusers' (Qwen-Image), as stored; gguf:TYPE: GGUF "
                           "in the same names (city96's layout), block weights quantized; fp8: "
                           "e4m3 block linears with per-row scales (ComfyUI's scale_weight)")
    conv.set_defaults(func=cmd_convert)
    insp = model_sub.add_parser(
        "inspect", help="print a checkpoint file's format, family and stored types")
    insp.add_argument("file", type=Path)
    insp.set_defaults(func=cmd_inspect)
