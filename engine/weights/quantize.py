"""``--quantization``: the DiT's linear layers in a lower-precision format, applied once after
loading.

``ModelRunner`` calls ``quantize_dit`` once the pipeline is built - resident, the DiT is on its
device already; with offload, on the host - and before ``enable_offload``: the offload plan
then lays the blocks' fp8 weights and fp32 scales out as ordinary block tensors (they stream
with the block, and AllGather shards them like any region), and regional compilation
(``--compile``) traces the FP8 linears inside each block's forward, fusing the per-token
activation quantization into the surrounding kernels.

Which layers: ``formats.fp8_select``'s rule (every ``nn.Linear`` inside the streamed block
lists, multiples of 16 only; embedders, norms and the final projection stay in ``--dtype``).
The block lists are the family table's for the transformer classes it knows (Flux,
Qwen-Image, Wan), else the offload discovery's rule (outermost ``ModuleList``s of repeated
blocks), so a newly registered family needs no table entry to be quantized.

On CUDA, ``torch._scaled_mm``'s rowwise FP8 needs compute capability 8.9 (Ada) or newer; other
GPUs are refused before anything changes. On a CPU the layers run an emulation of the same
math (tests and CI).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from ditserve.engine.errors import ConfigError
from ditserve.engine.families import declared_block_lists
from ditserve.engine.formats.fp8_select import FP8Rule, QuantizeReport, quantize_fp8

log = logging.getLogger(__name__)
FP8_MIN_CAPABILITY = (8, 9)


def fp8_rule(transformer: nn.Module) -> FP8Rule:
    """The family registry's rule, or one over the block lists offload discovery finds."""
    if declared_block_lists(type(transformer).__name__) is not None:
        return FP8Rule()
    from ditserve.engine.offload.discovery import discover

    blocks = discover(transformer).blocks  # ("<list>.<index>", module), in call order
    return FP8Rule(block_lists=tuple(dict.fromkeys(n.rpartition(".")[0] for n, _ in blocks)))


def quantize_dit(transformer: nn.Module, mode: str, *, device: torch.device) -> QuantizeReport:
    """Quantize ``transformer`` in place for ``--quantization mode`` on ``device`` (where it
    will run; on CUDA the quantization itself runs there too, layer by layer)."""
    if mode != "fp8":
        raise ConfigError(f"quantization {mode!r} is not supported; use fp8 or leave it unset")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            raise ConfigError(
                f"--quantization fp8 needs a GPU of compute capability "
                f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or newer (rowwise torch._scaled_mm); "
                f"{torch.cuda.get_device_name(device)} is "
                f"{'.'.join(map(str, capability))}: run without --quantization")
    started = time.perf_counter()
    report = quantize_fp8(transformer, fp8_rule(transformer),
                          work_device=device if device.type == "cuda" else None)
    log.info("quantized %d linear layers of %s to FP8 in %.1fs (%.2f -> %.2f GiB)",
             report.layers, type(transformer).__name__, time.perf_counter() - started,
             report.bf16_bytes / 2**30, report.fp8_bytes / 2**30)
    return report
