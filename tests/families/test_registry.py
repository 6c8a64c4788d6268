"""The family registry: the pure table and the torch-side pipelines agree; the option rule
for model.family; model directories are judged by their family; frame counts by the model."""

from __future__ import annotations

import json
import shutil

import pytest

from ditserve.engine import families
from ditserve.engine.config import MODEL_FAMILIES, RunnerConfig, model_family_problems
from ditserve.engine.errors import InvalidRequestError, ModelLoadError
from ditserve.engine.request import SamplingParams


def test_pure_and_torch_registries_agree() -> None:
    from ditserve.engine.pipelines.registry import PIPELINES, pipeline_class

    assert set(PIPELINES) == set(families.family_names())
    for family in families.FAMILIES:
        assert pipeline_class(family.name).family is family
        assert families.family_of_pipeline(family.pipeline_class) is family
    assert set(families.MODEL_VARIANTS.values()) == set(families.family_names())


@pytest.mark.parametrize("value", ["Auto", "Flux", "QwenImage", "Wan", "qwen-image", "wan",
                                   "flux", "auto", "ZImage", "z-image"])
def test_model_family_rule_accepts_registered_families(value: str) -> None:
    assert model_family_problems(value) == []


@pytest.mark.parametrize("value", ["SD3", "", "wan2.2", None, 3])
def test_model_family_rule_refuses_the_rest_and_names_the_choices(value: object) -> None:
    (problem,) = model_family_problems(value)
    assert problem.startswith("model.family must be one of Auto, Flux, QwenImage, Wan")
    assert MODEL_FAMILIES == ("Auto", "Flux", "QwenImage", "Wan", "ZImage", "Flux2", "Cosmos3",
                              "MiniMaxH3", "FluxKontext", "QwenImageEdit", "QwenImageEditPlus",
                              "WanI2V", "Flux2Klein")


def test_loader_reads_each_family_and_its_experts(family_dir) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.weights import loader

    assert loader.model_family(family_dir("qwen-image")) is families.QWEN_IMAGE
    assert loader.dit_components(family_dir("wan")) == ("transformer",)
    assert loader.dit_components(family_dir("wan2.2")) == ("transformer", "transformer_2")
    versions = {loader.loader_version(family_dir(v)) for v in ("qwen-image", "wan")}
    assert len(versions) == 2  # the cache identity differs per family
    assert loader.dit_source_files(family_dir("wan2.2"), "transformer_2")
    with pytest.raises(ModelLoadError, match="no DiT component 'transformer_3'"):
        loader.dit_source_files(family_dir("wan2.2"), "transformer_3")


def test_loader_refuses_wrong_layouts_with_what_it_found(family_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.weights.loader import read_model_index

    broken = tmp_path / "broken"
    shutil.copytree(family_dir("wan"), broken)
    index = json.loads((broken / "model_index.json").read_text())
    index["transformer"] = ["diffusers", "FluxTransformer2DModel"]
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="a WanPipeline serves WanTransformer3DModel"):
        read_model_index(broken)
    index["_class_name"] = "StableDiffusion3Pipeline"
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="supported: FluxPipeline, QwenImagePipeline, WanPipeline"):
        read_model_index(broken)
    shutil.rmtree(broken / "vae")
    index["_class_name"] = "WanPipeline"
    index["transformer"] = ["diffusers", "WanTransformer3DModel"]
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="missing component.s. vae"):
        read_model_index(broken)


def test_frame_counts_are_judged_by_the_model() -> None:
    video = SamplingParams(prompt="waves", num_frames=81)
    assert video.validate(frame_step=4) is video
    with pytest.raises(InvalidRequestError, match="try 77 or 81"):
        SamplingParams(prompt="waves", num_frames=80).validate(frame_step=4)
    with pytest.raises(InvalidRequestError, match="image model"):
        video.validate()  # an image model
    with pytest.raises(InvalidRequestError, match="num_frames"):
        SamplingParams(prompt="waves", num_frames=0).validate(frame_step=4)


def test_engine_validates_frames_for_a_video_model(family_runner) -> None:  # type: ignore[no-untyped-def]
    assert family_runner("wan").frame_step == 4
    assert family_runner("qwen-image").frame_step is None


def test_one_step_qwen_schedule_is_finite(family_runner) -> None:  # type: ignore[no-untyped-def]
    # diffusers' stretch to shift_terminal divides 0 by 0 for a single step (its own pipeline
    # returns NaN); the engine's warm-up and one-step requests must not.
    import torch

    schedule = family_runner("qwen-image").pipeline.sampler.schedule(1, 4)
    assert torch.isfinite(schedule.sigmas).all() and schedule.timesteps.tolist() == [1000.0]


def test_an_expert_without_its_switch_is_neither_loaded_nor_streamed(family_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # diffusers never runs transformer_2 without boundary_ratio; the loader does not load it.
    from ditserve.engine.config import EngineConfig, OffloadConfig
    from ditserve.engine.runner.model_runner import ModelRunner
    from ditserve.engine.weights.loader import dit_components

    model = tmp_path / "no-switch"
    shutil.copytree(family_dir("wan2.2"), model)
    index = json.loads((model / "model_index.json").read_text())
    index["boundary_ratio"] = None
    (model / "model_index.json").write_text(json.dumps(index))
    assert dit_components(model) == ("transformer",)
    runner = ModelRunner(RunnerConfig.of(EngineConfig(model=str(model), device="cpu",
                                                      offload=OffloadConfig(enabled=True))),
                         model_dir=model)
    try:
        assert len(runner.pipeline.experts) == 1
        assert runner.offload_report()["streamed_blocks"] == 2  # one expert's blocks
        assert runner.pipeline.boundary is None
    finally:
        runner.close()
