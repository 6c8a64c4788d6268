"""Adapters over lossless packed streaming (``--dlo-compress lossless``): the streamed blocks'
bf16 weights sit packed in host memory and are decoded into the device slots after each copy,
while the adapters' factors stay resident beside the slots. A step of requests with different
adapters, stacked adapters and none (two shapes: block-major lanes) must equal the resident,
unpacked bf16 run of the same step, and each request its solo resident run within bf16
rounding.

bf16 on the CPU: packing is bit-exact, so the packed run differs from the resident one only by
the CPU kernels' rounding of an offloaded run (docs/offload.md: within 1e-6)."""

from __future__ import annotations

import torch
from adapters.test_runner_modes import make_runner, ref  # type: ignore[import-not-found]
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import OffloadConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner

TOLERANCE = 1e-6  # the CPU offload tests' bound (docs/offload.md, "A known CPU discrepancy")
BF16_TOLERANCE = 2e-2  # pixels in [0, 1], as test_lora_gpu.py: bf16 sums in another order


def step(runner: ModelRunner) -> dict[int, list[tuple[str, SamplingParams]]]:
    def p(prompt: str, size: int, *loras: object) -> SamplingParams:
        return SamplingParams(prompt=prompt, seed=len(prompt), num_inference_steps=3,
                              height=size, width=size, loras=tuple(loras))  # type: ignore[arg-type]

    return {0: [("a-32", p("a cat", 32, ref(runner, "a"))),
                ("b-32", p("a dog", 32, ref(runner, "b", 0.7))),
                ("none-64", p("a tree", 64)),
                ("ab-64", p("a ship", 64, ref(runner, "a", 0.5), ref(runner, "b", 1.5)))]}


def test_packed_dlo_with_adapters_equals_resident_unpacked(adapter_models, lora_files) -> None:  # type: ignore[no-untyped-def]
    model, files = adapter_models("flux"), lora_files("flux")
    resident = make_runner(model, files, dtype="bfloat16")
    expected, _ = drive(resident, step(resident), max_num_seqs=4)
    solo = {rid: drive(resident, {0: [(rid, params)]}, max_num_seqs=1)[0][rid]
            for rid, params in step(resident)[0]}
    packed = make_runner(model, files, dtype="bfloat16",
                         offload=OffloadConfig(enabled=True, compress="lossless"))
    try:
        got, sizes = drive(packed, step(packed), max_num_seqs=4)
        report = packed.offload.report()
    finally:
        packed.close()
    assert sizes[0] == 4  # all four requests shared each step
    assert report["compress"] == "lossless" and report["backing"] == "pageable-packed"
    assert report["passes"] > 0 and report["packed_raw_bytes"] == report["streamed_bytes"]
    for rid, image in expected.items():
        torch.testing.assert_close(got[rid], image, atol=TOLERANCE, rtol=0, msg=rid)
        # and each request its solo run, within bf16 rounding (batched sums may round apart)
        diff = (got[rid] - solo[rid]).abs().max().item()
        assert diff <= BF16_TOLERANCE, f"{rid}: packed in a step differs from alone by {diff}"
    # the adapters changed what they touch: an adapted request differs from its base run
    base = dict(step(resident)[0])["a-32"]
    plain, _ = drive(resident, {0: [("plain", SamplingParams(
        **{**base.__dict__, "loras": ()}))]}, max_num_seqs=1)
    assert (plain["plain"] - expected["a-32"]).abs().max().item() > 1e-2
