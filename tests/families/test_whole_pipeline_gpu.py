"""The whole pipeline on CUDA (run on the device machine): text encoders streamed through DLO
slots from pinned host memory, or parked there, give exactly the outputs of resident
encoders, the prompt cache changes no output bit, and tiled decode stays within the CPU
test's tolerance of the whole decode; under an HBM
budget the measured peak stays under the planner's predicted peak (and the budget), and
``auto`` keeps a model that fits resident."""

from __future__ import annotations

import gc

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]

from ditserve.engine.allocator import cap_reserved
from ditserve.engine.config import EngineConfig, OffloadConfig, PipelineConfig, RunnerConfig
from ditserve.engine.placement.budget_plan import GIB, BudgetError
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.step.plan import RunnerOutput

pytestmark = pytest.mark.gpu


def arrivals(r: ModelRunner) -> dict[int, list[tuple[str, SamplingParams]]]:
    """Two CFG requests: true CFG where the model takes it, else CFG by guidance_scale."""
    common = {"height": 32, "width": 32, "num_inference_steps": 3, "guidance_scale": 3.0,
              **({"num_frames": 5} if r.frame_step is not None else {}),
              **({"true_cfg_scale": 3.0} if r.limits.true_cfg else {})}
    return {0: [("a", SamplingParams(prompt="a red fox", negative_prompt="fog", seed=1,
                                     **common)),
                ("b", SamplingParams(prompt="a red fox", negative_prompt="fog", seed=2,
                                     **common))]}


def run(model: object, *, components: str, cache: int) -> tuple[dict[str, torch.Tensor],
                                                                 ModelRunner]:
    r = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cuda",
                                                 offload=OffloadConfig(enabled=True,
                                                                       components=components),
                                                 pipeline=PipelineConfig(prompt_cache_size=cache))),
                    model_dir=model)  # type: ignore[arg-type]
    out, _ = drive(r, arrivals(r), max_num_seqs=2)
    return out, r


@pytest.mark.parametrize("variant", ["flux", "qwen-image", "wan"])
def test_streamed_encoders_on_cuda_equal_resident(family_dir, variant: str) -> None:  # type: ignore[no-untyped-def]
    model = family_dir(variant)
    want, resident = run(model, components="dit", cache=0)
    resident.close()
    del resident
    got, streamed = run(model, components="all", cache=0)
    cached, cached_runner = run(model, components="all", cache=256)
    try:
        plan = {row["name"]: row for row in streamed.pipeline_report()["plan"]}
        encoders = [name for name in plan if name.startswith("text_encoder")]
        assert encoders
        for name in encoders:
            assert plan[name]["lives"].startswith("streamed by DLO"), plan[name]
        assert cached_runner.pipeline_report()["prompt_cache"]["hits"] > 0
    finally:
        streamed.close()
        cached_runner.close()
    for rid in want:
        assert torch.equal(got[rid], want[rid]), rid
        assert torch.equal(cached[rid], want[rid]), rid


def budget_runner(model: object, budget: float | str) -> ModelRunner:
    return ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cuda",
                                                    offload=OffloadConfig(enabled=True,
                                                                          hbm_budget_gib=budget),
                                                    pipeline=PipelineConfig(prompt_cache_gib=0.25))),
                       model_dir=model)  # type: ignore[arg-type]


@pytest.mark.parametrize("variant", ["flux", "qwen-image", "wan"])
def test_measured_peak_stays_under_the_predicted_peak_at_the_smallest_budget(family_dir, variant: str) -> None:  # type: ignore[no-untyped-def]
    model = family_dir(variant)
    with pytest.raises(BudgetError) as refused:
        budget_runner(model, 0.01)
    minimum = refused.value.minimum_bytes
    # Whatever earlier tests left allocated is not this runner's: measure above it.
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    # The smallest budget it named (a hair above: GiB as a float rounds): every DiT block
    # streamed. (Tiny encoders may stay resident in that hair: their bytes are within it.)
    r = budget_runner(model, minimum / GIB + 1e-6)
    try:
        memory = r.pipeline_report()["memory"]
        assert memory["resident_blocks"] == 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out, _ = drive(r, arrivals(r), max_num_seqs=2)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - baseline
    finally:
        r.close()
    assert set(out) == {"a", "b"}
    print(f"{variant}: budget {minimum / GIB:.3f} GiB, predicted peak "
          f"{memory['predicted_peak_bytes'] / GIB:.3f} GiB, measured {measured / GIB:.3f} GiB")
    assert measured <= memory["predicted_peak_bytes"]
    assert measured + memory["slack_bytes"] <= memory["budget_bytes"]


def test_auto_keeps_a_model_that_fits_resident(family_dir) -> None:  # type: ignore[no-untyped-def]
    r = budget_runner(family_dir("flux"), "auto")
    try:
        memory, offload = r.pipeline_report()["memory"], r.offload_report()
        out, _ = drive(r, arrivals(r), max_num_seqs=2)
    finally:
        r.close()
    assert memory["auto"] and memory["budget_bytes"] > 0
    assert offload is not None and offload["streamed_blocks"] == 0  # never slower than resident
    assert memory["encoders"] == "resident" and memory["decode"] == "whole"
    assert set(out) == {"a", "b"}


@pytest.mark.parametrize("variant", ["flux", "qwen-image", "wan"])
def test_parked_encoders_on_cuda_equal_resident(family_dir, variant: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Encoders parked in pinned host memory (DLO finds layers in every one of them, so the
    choice is forced) visit the device for each encode and change no output bit."""
    from ditserve.engine.placement import whole_pipeline

    model = family_dir(variant)
    want, resident = run(model, components="dit", cache=0)
    resident.close()
    monkeypatch.setattr(whole_pipeline, "streamable", lambda module: False)
    got, parked = run(model, components="all", cache=0)
    try:
        plan = {row["name"]: row for row in parked.pipeline_report()["plan"]}
        encoders = [name for name in plan if name.startswith("text_encoder")]
        assert encoders and all(plan[name]["lives"].startswith("parked") for name in encoders)
    finally:
        parked.close()
    for rid in want:
        assert torch.equal(got[rid], want[rid]), rid


@pytest.mark.parametrize("variant", ["flux", "qwen-image", "wan"])
def test_tiled_decode_on_cuda_within_tolerance_of_whole_decode(family_dir, variant: str) -> None:  # type: ignore[no-untyped-def]
    """The CPU test's bounds (tests/families/test_whole_pipeline.py) hold for CUDA's
    kernels: tiled decode is the one placement whose math differs from the whole decode."""
    from families.test_whole_pipeline import (  # type: ignore[import-not-found]
        TILED_DECODE_MAX,
        TILED_DECODE_MEAN,
    )

    from ditserve.engine.pipelines.vae_decode import VaeTiling, tiled_post_decode
    from ditserve.engine.step.denoise_state import DenoiseState

    model = family_dir(variant)
    r = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cuda")),
                    model_dir=model)  # type: ignore[arg-type]
    try:
        pipeline = r.pipeline
        video = r.frame_step is not None
        params = SamplingParams(prompt="a fox", num_inference_steps=2, seed=5, height=96,
                                width=96, **({"num_frames": 5} if video else {}))
        state = DenoiseState("x", params, 5)
        pipeline.prepare_encode(state)  # noise latents: the decode sees every value range
        whole = DenoiseState("x", params, 5, latents=state.latents)
        pipeline.post_decode(whole)
        tiling = VaeTiling(pipeline.vae, tile_pixels=32)
        tiled = DenoiseState("x", params, 5, latents=state.latents)
        tiled_post_decode(pipeline.post_decode, tiling, mode="on", offload=False,
                          video=video)(tiled)
        assert whole.pixels is not None and tiled.pixels is not None
        difference = (tiled.pixels.float() - whole.pixels.float()).abs()
        assert 0 < difference.max().item() <= TILED_DECODE_MAX, difference.max().item()
        assert difference.mean().item() <= TILED_DECODE_MEAN, difference.mean().item()
    finally:
        r.close()


@pytest.mark.parametrize("variant", ["flux", "wan"])
def test_a_request_out_of_hbm_under_the_budget_fails_alone_and_serving_goes_on(family_dir, variant: str) -> None:  # type: ignore[no-untyped-def]
    """A numeric budget caps the allocator, so a request too large for what is left raises
    CUDA's out-of-memory error instead of growing past the budget. That request fails with
    the error named, and the same runner - DLO slots, streamed encoders, prompt cache -
    then serves requests bit-identical to those it served before."""
    model = family_dir(variant)
    with pytest.raises(BudgetError) as refused:
        budget_runner(model, 0.01)
    r = budget_runner(model, refused.value.minimum_bytes / GIB + 1e-6)
    index = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    try:
        video = r.frame_step is not None
        before, _ = drive(r, arrivals(r), max_num_seqs=2)
        # Squeeze the cap to what is reserved now: any new allocator segment is refused.
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_reserved(index) / total,
                                                   index)
        large = SamplingParams(prompt="a wide valley", seed=3, height=1024, width=1024,
                               num_inference_steps=2, **({"num_frames": 5} if video else {}))
        outputs: list[RunnerOutput] = []
        got, _ = drive(r, {0: [("large", large)]}, max_num_seqs=2, allow_failures=True,
                       outputs=outputs)
        failed = {rid: why for output in outputs for rid, why in output.failed.items()}
        # The runner's own cap back.
        cap_reserved(torch.device("cuda", index), r.pipeline_report()["memory"]["budget_bytes"])
        after, _ = drive(r, arrivals(r), max_num_seqs=2)
    finally:
        r.close()
    assert "large" not in got
    assert "out of memory" in failed.get("large", "").lower(), failed
    assert set(after) == set(before)
    for rid in before:
        assert torch.equal(after[rid], before[rid]), rid
