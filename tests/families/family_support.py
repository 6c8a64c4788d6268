"""What the families' reference tests share: tolerances, a request run through a pipeline by
hand, requests driven alone, a runner closed after use, result comparison."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from engine.driver import Arrivals, drive  # type: ignore[import-not-found]

from ditserve.engine.config import EngineConfig, RunnerConfig
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step.input_batch import InputBatchBuilder

TOLERANCE = 1e-3  # fp32 against diffusers, pixels in [0, 1]
AUDIO_TOLERANCE = 1e-3  # fp32 against diffusers, waveform samples in [-1, 1]
SAME = 1e-4  # ours against ours (batching, offload, SP sum in another order)

Grouping = Callable[[list[DenoiseState]], list[list[DenoiseState]]]


def one_group(running: list[DenoiseState]) -> list[list[DenoiseState]]:
    """Every running request in one forward (a packed family's batch takes any shapes)."""
    return [running]


def run_pipeline(runner: ModelRunner, requests: Sequence[tuple[str, SamplingParams]], *,
                 groups: Grouping = one_group) -> dict[str, DenoiseState]:
    """Every request through the runner's pipeline at once, by hand: one forward per step and
    group (``groups``) over the ones still running; each state keeps its pixels and sound."""
    pipeline = runner.pipeline
    states = {rid: DenoiseState(rid, p, p.seed or 0) for rid, p in requests}
    for state in states.values():
        pipeline.prepare_encode(state)
    builder = InputBatchBuilder()
    while running := [s for s in states.values()
                      if s.step_index < s.params.num_inference_steps]:
        for group in groups(running):
            batch = builder.build(group)
            output = pipeline.denoise_step(batch)
            for state, rows in zip(group, batch.split(output), strict=True):
                pipeline.step(state, rows)
    for state in states.values():
        pipeline.post_decode(state)
    return states


def drive_alone(runner: ModelRunner, arrivals: Arrivals) -> dict[str, torch.Tensor]:
    """Each request of ``arrivals`` driven on its own (a batch of one): the results the
    batched, offloaded and sequence-parallel runs must equal."""
    out: dict[str, torch.Tensor] = {}
    for requests in arrivals.values():
        for rid, params in requests:
            pixels, _ = drive(runner, {0: [(rid, params)]}, max_num_seqs=1)
            out[rid] = pixels[rid]
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for rid, pixels in want.items():
        assert got[rid].shape == pixels.shape
        diff = (got[rid] - pixels).abs().max().item()
        assert diff <= SAME, f"request {rid}: max abs diff {diff}"


@contextmanager
def open_runner(model: Path, **engine: Any) -> Iterator[ModelRunner]:
    """A ModelRunner on ``model`` (EngineConfig fields in ``engine``), closed on the way out."""
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), **engine)),
                         model_dir=model)
    try:
        yield runner
    finally:
        runner.close()


def true_cfg(variant: str) -> dict[str, float]:
    """A true-CFG scale where the variant's family takes one (Flux-like); elsewhere CFG is
    ``guidance_scale``, and a request's true_cfg_scale would be refused."""
    from ditserve.engine.families import family_of_variant

    family = family_of_variant(variant)
    return {"true_cfg_scale": 3.0} if family is not None and family.cfg_rows == "true_cfg" else {}
