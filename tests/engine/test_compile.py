"""--compile: regional torch.compile of the DiT's repeated blocks, with and without DLO.

CI has no guaranteed C++ compiler, so these trace with the ``aot_eager`` backend: dynamo and
AOTAutograd run exactly as with inductor, only the kernels stay PyTorch's. What they check is
the engine's side: which modules are compiled, that offload hooks keep working around compiled
blocks, and that outputs do not change across batch sizes and resolutions.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.config.flags import add_engine_options, engine_config_from_args
from ditserve.engine.errors import ConfigError
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner


def params(rid: str, steps: int, size: int = 64) -> SamplingParams:
    return SamplingParams(prompt=rid, num_inference_steps=steps, seed=len(rid) + steps,
                          height=size, width=size)


# Batch sizes 1, 2 and 1 again, then a second resolution: static, then dynamic shapes.
ARRIVALS = {0: [("a", params("a", 3))], 1: [("bb", params("bb", 2))],
            5: [("big", params("big", 2, size=96))]}


def run(model_dir, **config) -> tuple[ModelRunner, dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    config = EngineConfig(model=str(model_dir), device="cpu", **config)
    runner = ModelRunner(RunnerConfig.of(config), model_dir=model_dir)
    results, _ = drive(runner, ARRIVALS, max_num_seqs=2)
    return runner, results


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "dlo"])
def test_compiled_blocks_give_the_eager_outputs(tiny_model_dir, offload) -> None:  # type: ignore[no-untyped-def]
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    off = OffloadConfig(enabled=offload)
    _, eager = run(tiny_model_dir, offload=off)
    runner, compiled = run(tiny_model_dir, offload=off, compile="aot_eager")
    assert counters["stats"]["unique_graphs"] >= 2  # both block classes were really traced
    transformer = runner.pipeline.transformer
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    # Beneath the step cache's wrapper (it wraps each block's forward, compiled or not).
    assert all(hasattr(getattr(b.forward, "__wrapped__", b.forward), "_torchdynamo_orig_callable")
               for b in blocks)
    assert not hasattr(transformer.forward, "_torchdynamo_orig_callable")  # regional only
    assert eager.keys() == compiled.keys() == {"a", "bb", "big"}
    for rid in eager:
        torch.testing.assert_close(compiled[rid], eager[rid], atol=1e-5, rtol=0)
    if offload:
        report = runner.offload_report()
        assert report is not None and report["bytes_transferred"] > 0  # hooks still stream


def test_compile_flag_and_validation() -> None:
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert engine_config_from_args(parser.parse_args(["--compile"])).compile == "inductor"
    assert engine_config_from_args(
        parser.parse_args(["--compile", "aot_eager"])).compile == "aot_eager"
    assert engine_config_from_args(parser.parse_args([])).compile is None
    with pytest.raises(ConfigError, match="compile must be one of inductor, aot_eager, eager"):
        EngineConfig.from_mapping({"compile": "tensorrt"})


def test_inductor_without_a_compiler_is_refused_before_loading(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.runner.compiled_blocks import require_toolchain

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match="needs a C compiler .*install gcc"):
        require_toolchain("inductor", torch.device("cuda", 0))
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        require_toolchain("inductor", torch.device("cpu"))
    require_toolchain("aot_eager", torch.device("cuda", 0))  # traces only: nothing to build
    require_toolchain("eager", torch.device("cpu"))


def test_a_compiler_named_by_the_environment_is_enough(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.runner.compiled_blocks import require_toolchain

    compiler = tmp_path / "my-cc"
    compiler.write_text("#!/bin/sh\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CC", str(compiler))
    require_toolchain("inductor", torch.device("cuda", 0))  # no error


def test_engine_refuses_inductor_without_a_compiler_before_loading(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.runner.model_runner import ModelRunner

    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    config = EngineConfig.from_mapping({"compile": "inductor", "device": "cpu"})
    # The model directory does not exist: the check must fire before anything is read.
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        ModelRunner(RunnerConfig.of(config), model_dir=tmp_path / "missing")


def test_a_model_without_repeated_blocks_is_refused() -> None:
    from ditserve.engine.runner.compiled_blocks import compile_repeated_blocks

    with pytest.raises(ConfigError, match="does not declare its repeated blocks"):
        compile_repeated_blocks(torch.nn.Linear(2, 2), "eager")


def test_engine_compiles_before_ready_so_no_request_compiles(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from torch._dynamo.utils import counters

    from ditserve.engine.config import SchedulerConfig
    from ditserve.engine.loop.engine import DiffusionEngine, WarmUp

    torch._dynamo.reset()
    counters.clear()
    engine = DiffusionEngine(EngineConfig(model=str(tiny_model_dir), device="cpu",
                                          compile="aot_eager",
                                          scheduler=SchedulerConfig(max_num_seqs=3)),
                             warmup=WarmUp(compile_size=(96, 96)))
    engine.start()
    try:
        graphs_at_ready = counters["stats"]["unique_graphs"]
        assert graphs_at_ready >= 2
        # Batches of 1 to 3 at the warm-up size and at another size: nothing new compiles.
        handles = [engine.add_request(params(f"r{i}", 2, size=96)) for i in range(3)]
        handles.append(engine.add_request(params("other", 2, size=128)))
        for handle in handles:
            handle.result(timeout=120)
        assert counters["stats"]["unique_graphs"] == graphs_at_ready
    finally:
        engine.shutdown()
