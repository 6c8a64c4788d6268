"""Whole generations through the model runner in the host weight formats (bf16 tiny model, CPU):
lossless DLO == plain DLO bit for bit, FP8 DLO == FP8 resident, and what the report says."""

from __future__ import annotations

import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.formats.fp8_linear import FP8Linear
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner

ARRIVALS = {
    0: [("fox", SamplingParams(prompt="a red fox", num_inference_steps=3, seed=11)),
        ("cfg", SamplingParams(prompt="a castle", negative_prompt="blurry", true_cfg_scale=3.0,
                               num_inference_steps=2, seed=13))],
}


def runner(model_dir, **changes) -> ModelRunner:  # type: ignore[no-untyped-def]
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="bfloat16").replace(**changes)
    return ModelRunner(RunnerConfig.of(config), model_dir=model_dir)


def generate(r: ModelRunner) -> dict[str, torch.Tensor]:
    try:
        images, _ = drive(r, ARRIVALS, max_num_seqs=2)
        return images
    finally:
        r.close()


def test_lossless_dlo_generations_equal_plain_dlo_bit_for_bit(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    plain = generate(runner(tiny_model_dir, offload=OffloadConfig(enabled=True)))
    packed_runner = runner(tiny_model_dir,
                           offload=OffloadConfig(enabled=True, compress="lossless"))
    report = packed_runner.offload_report()
    packed = generate(packed_runner)
    assert plain.keys() == packed.keys()
    assert all(torch.equal(plain[k], packed[k]) for k in plain)
    # The report /ready and /metrics read: the packed bytes behind the streamed blocks.
    assert report is not None and report["compress"] == "lossless"
    assert report["packed_host_bytes"] == report["host_bytes"] > 0
    assert report["packed_raw_bytes"] == report["streamed_bytes"]


def test_fp8_dlo_generations_equal_fp8_resident(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    bf16 = generate(runner(tiny_model_dir))
    resident_runner = runner(tiny_model_dir, quantization="fp8")
    blocks = resident_runner.pipeline.transformer.transformer_blocks  # type: ignore[attr-defined]
    assert isinstance(blocks[0].attn.to_q, FP8Linear)
    resident = generate(resident_runner)
    dlo_runner = runner(tiny_model_dir, quantization="fp8", offload=OffloadConfig(enabled=True))
    report = dlo_runner.offload_report()
    dlo = generate(dlo_runner)
    assert all(torch.equal(dlo[k], resident[k]) for k in resident)
    assert any(not torch.equal(resident[k], bf16[k]) for k in bf16)  # it did quantize
    # fp8 weights and fp32 scales stream with each block: three dtype regions, fewer bytes.
    assert report is not None and report["backing_kind"] == "ordinary"
    assert "--quantization fp8" in report["backing_reason"]


def test_compiled_fp8_blocks_trace_whole_and_stream() -> None:
    import torch._dynamo as dynamo
    from formats.support import flux_inputs, tiny_flux  # type: ignore[import-not-found]
    from torch._dynamo.testing import CompileCounterWithBackend

    from ditserve.engine.formats.fp8_select import quantize_fp8
    from ditserve.engine.offload import enable_offload
    from ditserve.engine.runner.compiled_blocks import compile_repeated_blocks

    model = tiny_flux().to(torch.bfloat16)
    quantize_fp8(model)
    inputs = {k: v.to(torch.bfloat16) if k not in ("img_ids", "txt_ids")
              and isinstance(v, torch.Tensor) else v for k, v in flux_inputs(model).items()}
    with torch.no_grad():
        eager = model(**inputs)[0]
    dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    assert compile_repeated_blocks(model, counter) == 5  # type: ignore[arg-type]
    handle = enable_offload(model, OffloadConfig(enabled=True), "cpu")
    dynamo.utils.counters.clear()
    try:
        with torch.no_grad():
            outs = [model(**inputs)[0]]
            frames = counter.frame_count
            outs.append(model(**inputs)[0])  # warm: weights in other slots, same graphs
        breaks = dict(dynamo.utils.counters["graph_break"])
    finally:
        handle.disable()
        dynamo.reset()
    # The FP8 linears (per-token activation quantization + the scaled matmul) trace into
    # their block's graph - no graph break, which is what lets inductor fuse them - and the
    # graphs serve every block of a class and every slot: a graph per block class, plus the
    # one recompile plain Flux has too (the first single block's input strides differ).
    assert breaks == {}
    assert frames == counter.frame_count == 3
    assert all(torch.allclose(o.float(), eager.float(), rtol=0, atol=2e-2) for o in outs)
