"""Whole generations through the engine's model runner: DLO == resident, alone and batched."""

from __future__ import annotations

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, OffloadConfig, RunnerConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner

REQUESTS = {
    "plain": SamplingParams(prompt="a red fox", num_inference_steps=3, seed=11),
    "cfg": SamplingParams(prompt="a castle", negative_prompt="blurry", true_cfg_scale=3.0,
                          num_inference_steps=4, seed=13),
    "two": SamplingParams(prompt="two cats", num_inference_steps=2, seed=14, num_images=2),
}
ARRIVALS = {0: [("plain", REQUESTS["plain"]), ("cfg", REQUESTS["cfg"])], 1: [("two", REQUESTS["two"])]}


@pytest.fixture(scope="module")
def runners(tiny_model_dir):  # type: ignore[no-untyped-def]
    resident = ModelRunner(RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cpu")),
                           model_dir=tiny_model_dir)
    offloaded = ModelRunner(
        RunnerConfig.of(EngineConfig(model=str(tiny_model_dir), device="cpu",
                                     offload=OffloadConfig(enabled=True))),
        model_dir=tiny_model_dir,
    )
    yield resident, offloaded
    offloaded.offload.disable()


def test_generation_alone_is_identical(runners) -> None:  # type: ignore[no-untyped-def]
    resident, offloaded = runners
    for rid, params in REQUESTS.items():
        want, _ = drive(resident, {0: [(rid, params)]}, max_num_seqs=1)
        got, _ = drive(offloaded, {0: [(rid, params)]}, max_num_seqs=1)
        assert torch.equal(got[rid], want[rid]), rid


def test_batched_generation_is_identical_and_streams_once_per_step(runners) -> None:  # type: ignore[no-untyped-def]
    resident, offloaded = runners
    want, sizes = drive(resident, ARRIVALS, max_num_seqs=4)
    assert max(sizes) == 3, "the scenario must batch (CFG rows ride in the same forward)"
    drive(offloaded, {0: [("warm", REQUESTS["plain"])]}, max_num_seqs=1)  # past the cold load
    report = offloaded.offload.report()
    before = report["bytes_transferred"]
    got, sizes_dlo = drive(offloaded, ARRIVALS, max_num_seqs=4)
    assert sizes_dlo == sizes
    for rid in REQUESTS:
        assert torch.equal(got[rid], want[rid]), rid
    # One streamed pass per denoise step, however many rows (requests, CFG halves) it has.
    moved = offloaded.offload.report()["bytes_transferred"] - before
    assert moved == len(sizes) * report["streamed_bytes"]
