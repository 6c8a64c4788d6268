"""FP8 blocks through today's layer offload, unchanged: the fp8 weights and fp32 scales are
plain block tensors, so offloaded FP8 equals resident FP8 (the seam docs/formats.md claims)."""

from __future__ import annotations

import torch
from formats.support import flux_inputs, tiny_flux  # type: ignore[import-not-found]

from ditserve.engine.config import OffloadConfig
from ditserve.engine.formats.fp8_quant import FP8_DTYPE
from ditserve.engine.formats.fp8_select import quantize_fp8
from ditserve.engine.offload import enable_offload


def streamed_bytes(model: torch.nn.Module) -> int:
    handle = enable_offload(model, OffloadConfig(enabled=True), torch.device("cpu"))
    try:
        return int(handle.report()["streamed_bytes"])
    finally:
        handle.disable()


def test_offloaded_fp8_flux_equals_resident_fp8() -> None:
    model = tiny_flux()
    plain_bytes = streamed_bytes(model)
    quantize_fp8(model)
    inputs = flux_inputs(model)
    with torch.no_grad():
        resident = model(**inputs)[0]
    handle = enable_offload(model, OffloadConfig(enabled=True), torch.device("cpu"))
    try:
        with torch.no_grad():
            first = model(**inputs)[0]
            second = model(**inputs)[0]  # blocks now come back from their slots
        fp8_bytes = int(handle.report()["streamed_bytes"])
    finally:
        handle.disable()
    assert torch.equal(first, resident) and torch.equal(second, resident)
    # fp32 weights (4 bytes) -> e4m3 (1 byte) + a scale per row; biases and norms stay fp32.
    assert fp8_bytes < 0.4 * plain_bytes
    assert model.transformer_blocks[0].attn.to_q.weight_fp8.dtype == FP8_DTYPE  # type: ignore[index]
