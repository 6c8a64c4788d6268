"""The whole pipeline under one HBM budget, on tiny CPU models (issue 34): the engine refuses
a budget it cannot meet and names the smallest; a met budget is planned, printed and
reported; ``auto`` reads the device's free HBM; the prompts of a step are encoded in one
pass and same-shape decodes share one VAE call, each equal to doing it alone."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from ditserve.engine.config import (
    EngineConfig,
    OffloadConfig,
    PipelineConfig,
    ResolvedOffload,
    RunnerConfig,
    SchedulerConfig,
)
from ditserve.engine.errors import ConfigError
from ditserve.engine.placement.budget_plan import GIB, STREAMED, BudgetError
from ditserve.engine.placement.memory_estimates import auto_budget
from ditserve.engine.request import SamplingParams
from ditserve.engine.runner.model_runner import ModelRunner
from ditserve.engine.step.denoise_state import DenoiseState

VARIANTS = ["flux", "qwen-image", "wan", "z-image"]
PROMPTS = ["a red fox in the snow", "", "a castle", "a very long prompt " * 6]
# Batched encoder passes against one prompt per pass (the tiny float32 encoders): the
# families pad and mask as alone, so only kernels chosen per batch shape may differ
# (measured: Flux and Wan bit-identical, Qwen-Image 5e-7); batched decodes 7e-7.
ENCODE_TOLERANCE = 1e-5
DECODE_TOLERANCE = 1e-5


def budget_runner(model, budget: float | str, **pipeline):  # type: ignore[no-untyped-def]
    config = EngineConfig(model=str(model), device="cpu",
                          offload=OffloadConfig(enabled=True, hbm_budget_gib=budget),
                          pipeline=PipelineConfig(**pipeline))
    return ModelRunner(RunnerConfig.of(config), model_dir=model)


def test_a_budget_below_the_smallest_is_refused_with_the_smallest(family_dir) -> None:  # type: ignore[no-untyped-def]
    model = family_dir("flux")
    with pytest.raises(BudgetError) as refused:
        budget_runner(model, 0.25)
    assert isinstance(refused.value, ConfigError)
    minimum = refused.value.minimum_bytes
    assert "--dlo-hbm-budget-gib (0.25 GiB) cannot hold the pipeline" in str(refused.value)
    assert "prompt cache 1.00 GiB" in str(refused.value)  # the default bound counts
    # The smallest budget named is met: the engine starts and plans under it.
    r = budget_runner(model, minimum / GIB + 0.01)
    try:
        memory = r.pipeline_report()["memory"]
        table = r.whole.plan_table()
    finally:
        r.close()
    assert memory["budget_bytes"] >= minimum and memory["minimum_bytes"] == minimum
    assert memory["predicted_peak_bytes"] + memory["slack_bytes"] <= memory["budget_bytes"]
    assert "HBM budget:" in table and "the smallest this pipeline can run in" in table
    assert "predicted HBM peak:" in table and "activations (estimated" in table


def test_a_generous_budget_keeps_the_dit_and_encoders_resident(family_dir) -> None:  # type: ignore[no-untyped-def]
    r = budget_runner(family_dir("flux"), 8.0, prompt_cache_gib=0.25)
    try:
        report, offload = r.pipeline_report(), r.offload_report()
    finally:
        r.close()
    assert offload is not None and offload["streamed_blocks"] == 0
    assert report["memory"]["resident_blocks"] == offload["blocks"]
    rows = {row["name"]: row for row in report["plan"]}
    assert rows["text_encoder_2"]["lives"] == "resident"
    assert report["memory"]["encoders"] == "resident"


def test_auto_reads_the_free_hbm_and_refuses_without_a_gpu(family_dir) -> None:  # type: ignore[no-untyped-def]
    cuda = torch.device("cuda", 0)
    budget = auto_budget(cuda, mem_get_info=lambda d: (40 * GIB, 80 * GIB),
                         memory_reserved=lambda d: 2 * GIB)
    assert budget == 42 * GIB  # free, plus what this process already holds
    with pytest.raises(ConfigError, match="auto reads the free HBM of a CUDA device"):
        budget_runner(family_dir("flux"), "auto")
    assert EngineConfig.from_mapping(
        {"offload": {"enabled": True, "hbm_budget_gib": "auto"}}).offload.hbm_budget_gib == "auto"
    with pytest.raises(ConfigError, match="or 'auto'"):
        EngineConfig.from_mapping({"offload": {"enabled": True, "hbm_budget_gib": "lots"}})


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_encoder_pass_equals_one_pass_per_prompt(family_runner, variant: str) -> None:  # type: ignore[no-untyped-def]
    pipeline = family_runner(variant).pipeline
    length = int(pipeline.max_sequence_length)
    batched = pipeline._encode_prompts(PROMPTS, length)
    alone = [pipeline._encode_prompts([prompt], length)[0] for prompt in PROMPTS]
    for got, want in zip(batched, alone, strict=True):
        got_t = got if isinstance(got, tuple) else (got,)
        want_t = want if isinstance(want, tuple) else (want,)
        for g, w in zip(got_t, want_t, strict=True):
            assert g.shape == w.shape  # Qwen-Image: each prompt keeps its own length
            assert torch.allclose(g, w, rtol=0, atol=ENCODE_TOLERANCE), (g - w).abs().max()


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_step_encodes_its_prompts_in_one_pass(family_dir, variant: str) -> None:  # type: ignore[no-untyped-def]
    from engine.driver import drive  # type: ignore[import-not-found]

    extra = {"num_frames": 5} if variant == "wan" else {}
    arrivals = {0: [(f"r{i}", SamplingParams(prompt=PROMPTS[i % 3], negative_prompt="blur",
                                             true_cfg_scale=2.0, guidance_scale=3.0, seed=i,
                                             num_inference_steps=2, height=32, width=32,
                                             **extra)) for i in range(4)]}
    r = ModelRunner(RunnerConfig.of(EngineConfig(model=str(family_dir(variant)), device="cpu")),
                    model_dir=family_dir(variant))
    try:
        out, _ = drive(r, arrivals, max_num_seqs=4)
        report = r.pipeline_report()
    finally:
        r.close()
    assert set(out) == {"r0", "r1", "r2", "r3"}
    # Three distinct prompts and the negative: one pass, four prompts, the rest hits.
    assert report["encode"] == {"passes": 1, "prompts": 4, "ahead": 0}  # nobody waited
    assert report["prompt_cache"]["misses"] == 4 and report["prompt_cache"]["hits"] == 4
    assert report["decode"] == {"calls": 1, "requests": 4}


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_decode_call_equals_one_per_request(family_runner, variant: str) -> None:  # type: ignore[no-untyped-def]
    r = family_runner(variant)
    extra = {"num_frames": 5} if variant == "wan" else {}
    states = []
    for seed in (1, 2, 3):
        params = SamplingParams(prompt="a fox", num_inference_steps=2, seed=seed, height=48,
                                width=32, **extra)
        state = DenoiseState(f"r{seed}", params, seed)
        r.pipeline.prepare_encode(state)  # noise latents: every value range decodes
        states.append(state)
    alone = []
    for state in states:
        single = copy.copy(state)
        r.pipeline.post_decode(single)
        alone.append(single.pixels)
    calls = r.whole.decoder.calls
    assert r.whole.decode(states) == {}
    assert r.whole.decoder.calls == calls + 1  # the three shared one VAE call
    assert r.pipeline_report()["decode"]["requests"] >= 3
    for state, want in zip(states, alone, strict=True):
        assert state.pixels.shape == want.shape
        assert torch.allclose(state.pixels, want, rtol=0, atol=DECODE_TOLERANCE)


def test_encoders_the_plan_streams_equal_resident_encoders(family_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Wiring: encoders the plan streams go through DLO slots (the tiny encoders are too small
    for the planner to prefer it, so the choice is forced here) and change no output bit."""
    from engine.driver import drive  # type: ignore[import-not-found]

    from ditserve.engine.runner import assembly

    model = family_dir("flux")
    arrivals = {0: [(f"r{i}", SamplingParams(prompt=PROMPTS[i], seed=i, num_inference_steps=2,
                                             height=32, width=32)) for i in range(2)]}
    resident = budget_runner(model, 8.0, prompt_cache_size=0)
    try:
        assert resident.pipeline_report()["memory"]["encoders"] == "resident"
        want, _ = drive(resident, arrivals, max_num_seqs=2)
    finally:
        resident.close()
    plan_budget = assembly.plan_budget

    def streaming_plan(inputs, budget, *, auto):  # type: ignore[no-untyped-def]
        plan = plan_budget(inputs, budget, auto=auto)
        return dataclasses.replace(plan, encoders={name: STREAMED for name in plan.encoders})

    monkeypatch.setattr(assembly, "plan_budget", streaming_plan)
    streamed = budget_runner(model, 0.7, prompt_cache_size=0)
    try:
        rows = {row["name"]: row for row in streamed.pipeline_report()["plan"]}
        got, _ = drive(streamed, arrivals, max_num_seqs=2)
    finally:
        streamed.close()
    for name in ("text_encoder", "text_encoder_2"):
        assert rows[name]["lives"].startswith("streamed by DLO")
    assert set(got) == set(want)
    for rid in want:
        assert torch.equal(got[rid], want[rid]), rid


def test_image_to_video_decodes_one_request_per_call(family_runner) -> None:  # type: ignore[no-untyped-def]
    """Wan I2V mixes each request's own first-frame latents into its decode: no sharing."""
    r = family_runner("wan-i2v")
    assert not r.whole.decoder.batchable
    assert "same-shape decodes batched" not in r.whole.plan_table()
    assert r.whole.decoder.batchable == bool(getattr(r.pipeline, "batched_decode", True))


def test_edits_run_no_text_only_encoder_pass(family_runner) -> None:  # type: ignore[no-untyped-def]
    """Qwen-Image-Edit reads each prompt with its images: the batched text pass stages none."""
    r = family_runner("qwen-image-edit")
    before = r.pipeline_report()["encode"]["passes"]
    state = DenoiseState("e", SamplingParams(prompt="make it red", negative_prompt="blur",
                                             true_cfg_scale=4.0, height=32, width=32), 1)
    with r.whole.encoding([state]):
        pass
    assert r.pipeline_report()["encode"]["passes"] == before


def test_a_refused_budget_is_the_servers_termination_message(family_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`ditserve serve` under a budget it cannot meet exits, and the refusal - with the
    smallest budget - is the pod's termination message (the operator's status reads it)."""
    import os
    import subprocess
    import sys

    from ports import free_port  # type: ignore[import-not-found]

    port = free_port()
    log = tmp_path / "termination-log"
    log.write_text("")  # the kubelet creates the file before the container starts
    env = {**os.environ, "DITSERVE_TERMINATION_LOG": str(log), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "ditserve.engine.cli", "serve", "--model",
         str(family_dir("flux")), "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
         "--offload", "dlo", "--dlo-hbm-budget-gib", "0.1"],
        capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    said = log.read_text()
    assert "--dlo-hbm-budget-gib (0.10 GiB) cannot hold the pipeline" in said, done.stderr[-2000:]
    assert "the smallest budget it can run in is" in said


def test_activation_estimates_use_the_pipelines_compute_dtype(family_runner, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Hidden states are counted in the pipeline's compute dtype, not the DiT's first
    parameter's: diffusers keeps Wan's scale_shift_table in float32 ahead of bf16 weights."""
    from ditserve.engine.placement.memory_estimates import budget_inputs

    pipeline = family_runner("wan").pipeline
    settings = dict(scheduler=SchedulerConfig(), pipeline_config=PipelineConfig(),
                    offload=ResolvedOffload())
    assert next(pipeline.transformer.parameters()).dtype == torch.float32
    float32 = budget_inputs(pipeline, **settings).denoise_activations
    monkeypatch.setattr(pipeline, "dtype", torch.bfloat16)  # a bf16 DiT, float32 table first
    assert budget_inputs(pipeline, **settings).denoise_activations * 2 == float32


def test_a_numeric_budget_caps_the_caching_allocator_and_auto_does_not(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from ditserve.engine.placement import whole_pipeline

    calls: list[tuple[float, int]] = []

    def set_fraction(fraction: float, device: object) -> None:
        # torch's own rule: an index, or a torch.device that carries one.
        assert isinstance(device, int), device
        calls.append((fraction, device))

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(total_memory=100 * GIB))
    plan = SimpleNamespace(budget=10 * GIB, auto=False)
    assert whole_pipeline.cap_allocator(torch.device("cuda"), plan) == 3  # type: ignore[arg-type]
    assert whole_pipeline.cap_allocator(torch.device("cuda", 1), plan) == 1  # type: ignore[arg-type]
    assert calls == [(0.1, 3), (0.1, 1)]
    auto = SimpleNamespace(budget=10 * GIB, auto=True)
    assert whole_pipeline.cap_allocator(torch.device("cuda"), auto) is None  # type: ignore[arg-type]
    assert whole_pipeline.cap_allocator(torch.device("cpu"), plan) is None  # type: ignore[arg-type]
    assert whole_pipeline.cap_allocator(torch.device("cuda"), None) is None
    assert len(calls) == 2


@pytest.mark.parametrize(("offload", "components", "moved"),
                         [(False, "all", True), (True, "dit", True), (True, "all", False)])
def test_the_whole_pipeline_places_resident_encoders_and_leaves_offloaded_ones_on_the_host(  # type: ignore[no-untyped-def]
        family_dir, monkeypatch, offload: bool, components: str, moved: bool) -> None:
    """Pipelines leave their text encoders where the loader put them, and the whole
    pipeline places them: an offloading engine's are streamed or parked from there (the
    device never holds one whole); resident encoders - no offload, ``--dlo-components
    dit`` - are moved to the device, once."""
    placed: list[str] = []  # the tiny Flux's encoder classes, each time one is moved
    real_to = torch.nn.Module.to

    def recording_to(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if (type(self).__name__ in ("CLIPTextModel", "T5EncoderModel")
                and any(isinstance(a, (torch.device, str)) for a in (*args, *kwargs.values()))):
            placed.append(type(self).__name__)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    model = family_dir("flux")
    r = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu",
                                                 offload=OffloadConfig(enabled=offload,
                                                                       components=components))),
                    model_dir=model)
    try:
        assert sorted(placed) == (["CLIPTextModel", "T5EncoderModel"] if moved else [])
        modes = {row["name"]: row["lives"] for row in r.pipeline_report()["plan"]}
        want = "resident" if moved else "streamed by DLO"
        assert all(modes[name].startswith(want) for name in ("text_encoder", "text_encoder_2"))
    finally:
        r.close()


def test_a_budget_that_keeps_encoders_resident_places_them(family_dir, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Under a budget the plan decides after the pipeline is built: encoders it keeps
    resident are moved to the device then."""
    from ditserve.engine.placement import whole_pipeline

    placed: list[str] = []
    real = whole_pipeline.WholePipeline._encoder_modes

    def modes(encoders, config, budget):  # type: ignore[no-untyped-def]
        for name, module in encoders.items():
            original = module.to

            def recording_to(*args, _name=name, _original=original, **kwargs):  # type: ignore[no-untyped-def]
                placed.append(_name)
                return _original(*args, **kwargs)

            module.to = recording_to
        return real(encoders, config, budget)

    monkeypatch.setattr(whole_pipeline.WholePipeline, "_encoder_modes", staticmethod(modes))
    r = budget_runner(family_dir("flux"), 8.0)
    try:
        assert r.pipeline_report()["memory"]["encoders"] == "resident"
        assert sorted(placed) == ["text_encoder", "text_encoder_2"]
    finally:
        r.close()


def test_a_budget_the_defaults_miss_lowers_the_prompt_cache_and_the_requests_per_step(family_dir, caplog) -> None:  # type: ignore[no-untyped-def]
    """Issue 45: a budget the default settings miss only by the prompt cache's 1 GiB bound,
    or by the step's work, is met by lowering them (each change logged) instead of refused;
    the runner's prompt cache and the engine's scheduler then use the lowered settings."""
    import logging

    from ditserve.engine.config import SchedulerConfig
    from ditserve.engine.loop.engine import DiffusionEngine

    model = family_dir("flux")
    with caplog.at_level(logging.WARNING):
        r = budget_runner(model, 1.0)
    try:
        assert r.config.pipeline.prompt_cache_gib == 0.25
        assert r.whole.cache.max_bytes == int(0.25 * GIB)
        assert r.pipeline_report()["memory"]["lowered"] == ["--prompt-cache-gib 1 -> 0.25"]
    finally:
        r.close()
    assert "lowered --prompt-cache-gib 1 -> 0.25" in caplog.text
    # A step budget far past what 1.5 GiB holds: the requests per step come down with it.
    config = EngineConfig(model=str(model), device="cpu",
                          offload=OffloadConfig(enabled=True, hbm_budget_gib=1.5),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_batch_tokens=1 << 20))
    engine = DiffusionEngine(config).start()
    try:
        scheduling = engine.config.scheduler
        assert scheduling.max_num_seqs < 8
        assert scheduling.max_batch_tokens == (1 << 20) * scheduling.max_num_seqs // 8
        assert engine.schedulers[0].config.max_num_seqs == scheduling.max_num_seqs
        memory = engine.pipeline_report()["memory"]
        assert any("--max-num-seqs 8 ->" in line for line in memory["lowered"])
        assert memory["predicted_peak_bytes"] + memory["slack_bytes"] <= memory["budget_bytes"]
        result = engine.add_request(SamplingParams(prompt="x", num_inference_steps=1))
        assert result.result(timeout=120).images
    finally:
        engine.shutdown()
