"""Adapters beside FP8 linears (``--quantization fp8``) on the CPU, where ``FP8Linear`` runs
its emulation (the same math as CUDA's ``torch._scaled_mm``; ``test_lora_gpu.py`` runs the
kernel): the base matmul stays FP8 while each adapter's delta is computed in bf16, the
activations' dtype, from bf16 factors - never quantized. A bf16 step of requests with
different adapters and none, FP8 and under DLO, equals the resident FP8 step."""

from __future__ import annotations

import torch
from adapters.test_packed import step  # type: ignore[import-not-found]
from adapters.test_runner_modes import make_runner  # type: ignore[import-not-found]
from engine.driver import drive  # type: ignore[import-not-found]
from torch import nn

from ditserve.engine.adapters.files import LoraFactors
from ditserve.engine.adapters.linear import AdaptedLinear
from ditserve.engine.adapters.rows import RowAdapters, RowSegment, applying
from ditserve.engine.config import OffloadConfig
from ditserve.engine.formats.fp8_linear import FP8Linear
from ditserve.engine.request import SamplingParams

TOLERANCE = 1e-6  # the CPU offload tests' bound (docs/offload.md)


@torch.no_grad()
def test_the_delta_beside_an_fp8_linear_is_the_bf16_delta() -> None:
    torch.manual_seed(0)
    fp8 = FP8Linear.from_linear(nn.Linear(64, 32).to(torch.bfloat16))
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    factors = LoraFactors(down=torch.randn(4, 64, dtype=torch.bfloat16),
                          up=torch.randn(32, 4, dtype=torch.bfloat16), scaling=0.5)
    base = fp8(x)
    layer = AdaptedLinear("l", fp8)
    layer.add(("a", 0), factors)
    with applying(RowAdapters(3, (RowSegment(1, 2, ((("a", 0), 2.0),)),))):
        adapted = fp8(x)
    assert adapted.dtype == torch.bfloat16
    assert torch.equal(adapted[0], base[0]) and torch.equal(adapted[2], base[2])
    # Row 1: the FP8 base plus the delta in bf16 (x @ down.T) @ up.T at scale x scaling.
    want = base[1].clone()
    want.addmm_(x[1] @ factors.down.t(), factors.up.t(), alpha=2.0 * 0.5)
    assert torch.equal(adapted[1], want)


def test_fp8_dlo_step_with_adapters_equals_resident_fp8(adapter_models, lora_files) -> None:  # type: ignore[no-untyped-def]
    model, files = adapter_models("flux"), lora_files("flux")
    resident = make_runner(model, files, dtype="bfloat16", quantization="fp8")
    expected, _ = drive(resident, step(resident), max_num_seqs=4)
    offloaded = make_runner(model, files, dtype="bfloat16", quantization="fp8",
                            offload=OffloadConfig(enabled=True))
    try:
        got, sizes = drive(offloaded, step(offloaded), max_num_seqs=4)
        assert offloaded.offload.report()["passes"] > 0
    finally:
        offloaded.close()
    assert sizes[0] == 4
    for rid, image in expected.items():
        torch.testing.assert_close(got[rid], image, atol=TOLERANCE, rtol=0, msg=rid)
    stacked = dict(step(resident)[0])["ab-64"]
    plain, _ = drive(resident, {0: [("plain", SamplingParams(
        **{**stacked.__dict__, "loras": ()}))]}, max_num_seqs=1)
    assert (expected["ab-64"] - plain["plain"]).abs().max().item() > 1e-2  # deltas applied
