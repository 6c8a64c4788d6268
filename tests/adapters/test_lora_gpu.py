"""LoRA adapters on CUDA (run on the device): a step mixing adapters, stacked adapters and a
request without one equals each request alone, resident and under DLO (whose copies run on a
side stream: a missing wait would show here, not on the CPU), in bf16; and the FP8 path
(rowwise ``torch._scaled_mm`` on sm89+) takes the bf16 delta, also under DLO; lossless packed
DLO (decoded on the GPU) equals resident bitwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.adapters.bank import startup_refs
from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.config.adapters import AdapterConfig
from ditserve.engine.request import LoraRef, SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner

pytestmark = pytest.mark.gpu

BF16_TOLERANCE = 2e-2  # pixels in [0, 1]; bf16 sums in another order when batched


def runner_of(model, files, **extra: Any) -> ModelRunner:  # type: ignore[no-untyped-def]
    adapters = AdapterConfig(lora_modules={name: str(path) for name, path in files.items()})
    return ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cuda", dtype="bfloat16",
                                                    adapters=adapters, **extra)), model_dir=model)


def requests(runner: ModelRunner) -> list[tuple[str, SamplingParams]]:
    known = {r.name: r for r in startup_refs(runner.config.adapters)}

    def ref(name: str, scale: float) -> LoraRef:
        return LoraRef(name, known[name].path, scale=scale, version=known[name].version)

    def p(prompt: str, size: int, *loras: LoraRef) -> SamplingParams:
        return SamplingParams(prompt=prompt, seed=len(prompt), num_inference_steps=3,
                              height=size, width=size, loras=loras)

    return [("a", p("a cat", 64, ref("a", 1.0))), ("b", p("a dog", 64, ref("b", 0.8))),
            ("none", p("a tree", 64)), ("ab", p("a ship", 32, ref("a", 0.5), ref("b", 1.0)))]


@pytest.mark.parametrize("offload", [None, OffloadConfig(enabled=True),
                                     OffloadConfig(enabled=True, compress="lossless")],
                         ids=["resident", "dlo", "dlo-packed"])
def test_mixed_adapters_equal_solo_on_cuda(adapter_models, lora_files,
                                           offload: OffloadConfig | None) -> None:  # type: ignore[no-untyped-def]
    extra = {"offload": offload} if offload is not None else {}
    runner = runner_of(adapter_models("flux"), lora_files("flux"), **extra)
    try:
        batch = requests(runner)
        together, sizes = drive(runner, {0: batch}, max_num_seqs=4)
        assert max(sizes) == 4
        for rid, p in batch:
            alone, _ = drive(runner, {0: [(f"alone-{rid}", p)]}, max_num_seqs=1)
            diff = (together[rid] - alone[f"alone-{rid}"]).abs().max().item()
            assert diff <= BF16_TOLERANCE, f"{rid}: {diff}"
        assert (together["a"] - together["none"]).abs().max().item() > BF16_TOLERANCE
    finally:
        runner.close()


def test_fp8_takes_the_bf16_delta(adapter_models, lora_files) -> None:  # type: ignore[no-untyped-def]
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm89+")
    runner = runner_of(adapter_models("flux"), lora_files("flux"), quantization="fp8")
    batch = requests(runner)
    out, _ = drive(runner, {0: batch}, max_num_seqs=4)
    assert (out["a"] - out["none"]).abs().max().item() > BF16_TOLERANCE
    alone, _ = drive(runner, {0: [("a-alone", batch[0][1])]}, max_num_seqs=1)
    assert (out["a"] - alone["a-alone"]).abs().max().item() <= BF16_TOLERANCE


def test_packed_dlo_with_adapters_equals_resident_on_cuda(adapter_models, lora_files) -> None:  # type: ignore[no-untyped-def]
    resident = runner_of(adapter_models("flux"), lora_files("flux"))
    packed = runner_of(adapter_models("flux"), lora_files("flux"),
                       offload=OffloadConfig(enabled=True, compress="lossless"))
    try:
        want, _ = drive(resident, {0: requests(resident)}, max_num_seqs=4)
        got, _ = drive(packed, {0: requests(packed)}, max_num_seqs=4)
        assert packed.offload.report()["compress"] == "lossless"
    finally:
        packed.close()
    for rid, image in want.items():  # the decoded weights are the bf16 weights, bit for bit
        assert torch.equal(got[rid], image), rid


def test_fp8_dlo_takes_the_bf16_delta(adapter_models, lora_files) -> None:  # type: ignore[no-untyped-def]
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm89+")
    resident = runner_of(adapter_models("flux"), lora_files("flux"), quantization="fp8")
    offloaded = runner_of(adapter_models("flux"), lora_files("flux"), quantization="fp8",
                          offload=OffloadConfig(enabled=True))
    try:
        want, _ = drive(resident, {0: requests(resident)}, max_num_seqs=4)
        got, _ = drive(offloaded, {0: requests(offloaded)}, max_num_seqs=4)
    finally:
        offloaded.close()
    for rid, image in want.items():
        assert torch.equal(got[rid], image), rid
