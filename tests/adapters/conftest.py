"""Tiny models of the families, a runner per family that serves adapters, and small
random LoRA files made for them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from adapters.lora_files import kohya_flux_lora, peft_lora  # type: ignore[import-not-found]

from ditserve.engine.config import RunnerConfig

FEED_FORWARD = {"flux": ("ff.net.2", "proj_mlp"), "qwen-image": ("img_mlp.net.2",),
                "wan": ("ffn.net.2",), "z-image": ("feed_forward.w2",),
                "flux2": ("ff.linear_out", "to_qkv_mlp_proj"),
                "flux2-klein": ("ff_context.linear_in", "attn.to_out")}


@pytest.fixture(scope="session")
def adapter_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    from ditserve.engine.makers.tiny_model import init_tiny

    root = tmp_path_factory.mktemp("adapter-models")
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = init_tiny(root / family, family=family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def lora_files(adapter_models, tmp_path_factory) -> Callable[[str], dict[str, Path]]:  # type: ignore[no-untyped-def]
    """lora_files(family) -> {"a": attention rank 4, "b": feed-forward rank 8 [, "kohya"]}."""
    from diffusers import DiffusionPipeline

    root = tmp_path_factory.mktemp("adapter-files")
    made: dict[str, dict[str, Path]] = {}

    def get(family: str) -> dict[str, Path]:
        if family not in made:
            dit = DiffusionPipeline.from_pretrained(adapter_models(family)).transformer
            out = root / family
            out.mkdir()
            files = {
                "a": peft_lora(dit, out / "a.safetensors", rank=4, seed=1),
                "b": peft_lora(dit, out / "b.safetensors", rank=8, seed=2,
                               targets=("to_q",) + FEED_FORWARD[family]),
            }
            if family == "flux":
                files["kohya"] = kohya_flux_lora(dit, out / "kohya.safetensors", rank=4,
                                                 alpha=2.0, seed=3)
            made[family] = files
        return made[family]

    return get


@pytest.fixture(scope="session")
def adapter_runner(adapter_models, lora_files) -> Callable[..., Any]:  # type: ignore[no-untyped-def]
    """adapter_runner(family) -> a resident CPU ModelRunner that knows every file above."""
    from ditserve.engine.config import EngineConfig
    from ditserve.engine.config.adapters import AdapterConfig
    from ditserve.engine.runner.model_runner import ModelRunner

    runners: dict[str, Any] = {}

    def get(family: str) -> Any:
        if family not in runners:
            model = adapter_models(family)
            modules = {name: str(path) for name, path in lora_files(family).items()}
            config = EngineConfig(model=str(model), device="cpu",
                                  adapters=AdapterConfig(lora_modules=modules))
            runners[family] = ModelRunner(RunnerConfig.of(config), model_dir=model)
        return runners[family]

    return get
