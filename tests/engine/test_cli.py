"""The `ditserve` command line: the flag set is frozen, options map onto EngineConfig."""

from __future__ import annotations

import argparse

import pytest

from ditserve.engine.cli.main import build_parser, main
from ditserve.engine.config.flags import engine_config_from_args
from ditserve.engine.errors import ConfigError

ENGINE_FLAGS = {
    "--model", "--base-model", "--dtype", "--device", "--compile", "--max-num-seqs",
    "--max-batch-tokens", "--max-request-tokens", "--urgent-companions", "--plan-at",
    "--max-bypass",
    "--max-queue", "--offload", "--dlo-slots", "--dlo-resident-layers", "--dlo-hbm-budget-gib",
    "--dlo-no-use-allgather", "--dlo-gather", "--dlo-runtime-cache", "--cache-root",
    "--dlo-pin-limit-gib",
    "--dlo-checkpoint-mmap", "--data-parallel-size", "--sequence-parallel-size",
    "--quantization", "--dlo-compress", "--dlo-dequant",
    "--lora-modules", "--max-loras", "--max-lora-rank", "--lora-fuse",
    "--scheduling-policy", "--priority-aging-s", "--max-preemptions",
    "--dlo-components", "--prompt-cache-size", "--prompt-cache-gib", "--vae-tiling",
    "--step-cache", "--step-cache-threshold", "--step-cache-every",
}


def flags(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {opt for action in sub.choices[command]._actions for opt in action.option_strings
            if opt.startswith("--") and opt != "--help"}


def test_generate_flag_set_is_frozen() -> None:
    # Renaming or dropping a flag breaks users' scripts and the operator: change this on purpose.
    assert flags("generate") == ENGINE_FLAGS | {
        "--prompt", "--negative-prompt", "--out", "--height", "--width", "--steps", "--seed",
        "--guidance-scale", "--true-cfg-scale", "--num-images", "--num-frames", "--fps",
        "--image", "--last-image", "--reference", "--mask", "--strength", "--audio",
        "--max-sequence-length",
        "--lora",
    }


def test_serve_and_worker_take_every_engine_flag_and_a_config_file() -> None:
    assert ENGINE_FLAGS | {"--config"} <= flags("serve")
    assert flags("worker") == ENGINE_FLAGS | {"--config"}


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", "--prompt", "p", *argv])


def test_flags_override_the_config_file_and_map_onto_sections() -> None:
    base = {"dtype": "bfloat16", "scheduler": {"max_num_seqs": 2, "max_bypass": 0},
            "offload": {"enabled": True, "resident_layers": 1}}
    config = engine_config_from_args(
        parse("--max-num-seqs", "8", "--dlo-resident-layers", "3", "--data-parallel-size", "2",
              "--dlo-no-use-allgather", "--max-batch-tokens", "32768"), base)
    assert config.dtype == "bfloat16"
    assert config.scheduler.max_num_seqs == 8 and config.scheduler.max_bypass == 0
    assert config.scheduler.max_batch_tokens == 32768
    assert config.offload.enabled and config.offload.resident_layers == 3
    assert config.offload.use_allgather is False
    assert config.parallel.data_parallel_size == 2
    plain = {"offload": {"enabled": True}}
    assert engine_config_from_args(parse("--offload", "none"), plain).offload.enabled is False


def test_invalid_combinations_are_reported_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="only apply with offload enabled"):
        engine_config_from_args(parse("--dlo-resident-layers", "2"))
    # Every offload setting a user can change is refused without offload, not ignored.
    for flags in (("--dlo-components", "dit"), ("--dlo-no-use-allgather",)):
        with pytest.raises(ConfigError, match="only apply with offload enabled"):
            engine_config_from_args(parse(*flags))
    with pytest.raises(ConfigError, match="offload.checkpoint_mmap only apply"):
        engine_config_from_args(parse(), {"offload": {"checkpoint_mmap": "off"}})
    with pytest.raises(ConfigError, match="unknown option"):
        engine_config_from_args(parse(), {"scheduler": {"max_seqs": 1}})
    # A removed option says what replaces it.
    with pytest.raises(ConfigError, match="parallel.tensor_parallel_size was removed: tensor "
                                          "parallelism is not supported"):
        engine_config_from_args(parse(), {"parallel": {"tensor_parallel_size": 1}})
    with pytest.raises(ConfigError, match="scheduler.policy was removed: fifo admission is "
                                          "max_bypass: 0"):
        engine_config_from_args(parse(), {"scheduler": {"policy": "fifo"}})
    # scheduler.max_loras was overwritten by --max-loras without a word: it is gone.
    with pytest.raises(ConfigError, match="scheduler.max_loras was removed: .*adapters.max_loras"):
        engine_config_from_args(parse(), {"scheduler": {"max_loras": 2}})


def test_scheduling_flags_map_onto_the_scheduler_config() -> None:
    config = engine_config_from_args(parse("--scheduling-policy", "priority",
                                           "--priority-aging-s", "5", "--max-preemptions", "1"))
    assert (config.scheduler.scheduling_policy, config.scheduler.aging_s,
            config.scheduler.max_preemptions) == ("priority", 5.0, 1)
    assert engine_config_from_args(parse()).scheduler.scheduling_policy == "fcfs"
    with pytest.raises(ConfigError, match="scheduler.scheduling_policy must be one of fcfs, "
                                          "priority"):
        engine_config_from_args(parse(), {"scheduler": {"scheduling_policy": "lifo"}})


def test_whole_pipeline_flags_map_onto_the_pipeline_and_offload_config() -> None:
    config = engine_config_from_args(parse("--offload", "dlo", "--dlo-components", "dit",
                                           "--prompt-cache-size", "0", "--prompt-cache-gib",
                                           "0.5", "--vae-tiling", "on"))
    assert config.offload.components == "dit"
    assert (config.pipeline.prompt_cache_size, config.pipeline.prompt_cache_gib,
            config.pipeline.vae_tiling) == (0, 0.5, "on")
    default = engine_config_from_args(parse())
    assert (default.offload.components, default.pipeline.prompt_cache_size,
            default.pipeline.vae_tiling) == ("all", 256, "auto")
    with pytest.raises(ConfigError, match="pipeline.prompt_cache_size must be an integer >= 0"):
        engine_config_from_args(parse(), {"pipeline": {"prompt_cache_size": -1}})
    with pytest.raises(ConfigError, match="pipeline.vae_tiling must be one of auto, on, off"):
        engine_config_from_args(parse(), {"pipeline": {"vae_tiling": "maybe"}})
    with pytest.raises(SystemExit):  # argparse refuses an unknown choice
        parse("--dlo-components", "encoders")


def test_missing_model_directory_is_a_clean_error(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    code = main(["generate", "--prompt", "x", "--model", str(tmp_path / "nope"), "--device", "cpu"])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_worker_without_rendezvous_explains_itself(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert main(["worker"]) == 2
    assert "WORLD_SIZE > 1 and RANK >= 1" in capsys.readouterr().err


def test_init_tiny_is_safe_for_concurrent_processes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    target = tmp_path / "tiny"
    code = f"from ditserve.engine.makers.tiny_model import init_tiny; init_tiny({str(target)!r})"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    from ditserve.engine.weights.loader import read_model_index

    assert read_model_index(target)[0] == "FluxPipeline"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tiny.")]  # no leftovers


def test_dlo_dequant_maps_onto_the_offload_config_and_needs_offload() -> None:
    config = engine_config_from_args(parse("--offload", "dlo", "--dlo-dequant", "slot"))
    assert config.offload.dequant == "slot"
    assert engine_config_from_args(parse()).offload.dequant == "compute"
    with pytest.raises(ConfigError, match="offload.dequant=slot .* needs offload.enabled"):
        engine_config_from_args(parse("--dlo-dequant", "slot"))
    with pytest.raises(ConfigError, match="offload.dequant=slot and offload.compress=lossless"):
        engine_config_from_args(parse("--offload", "dlo", "--dlo-dequant", "slot",
                                      "--dlo-compress", "lossless"))
    with pytest.raises(SystemExit):  # argparse refuses an unknown choice
        parse("--dlo-dequant", "host")
