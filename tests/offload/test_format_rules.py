"""The option rules of the host weight formats (``engine.config.format_problems``): every
combination of ``--dlo-compress lossless`` and ``--quantization fp8`` with the rest."""

from __future__ import annotations

import argparse

import pytest

from ditserve.engine.config import EngineConfig, OffloadConfig, ParallelConfig, problems
from ditserve.engine.config.flags import add_engine_options, engine_config_from_args
from ditserve.engine.errors import ConfigError

DLO = OffloadConfig(enabled=True)
LOSSLESS = OffloadConfig(enabled=True, compress="lossless")


def config(**changes) -> EngineConfig:  # type: ignore[no-untyped-def]
    return EngineConfig(dtype="bfloat16").replace(**changes)


ACCEPTED = {
    "lossless DLO": config(offload=LOSSLESS),
    "lossless + compile": config(offload=LOSSLESS, compile="inductor"),
    "lossless + resident layers": config(offload=OffloadConfig(
        enabled=True, compress="lossless", resident_layers=2)),
    "lossless + HBM budget": config(offload=OffloadConfig(
        enabled=True, compress="lossless", hbm_budget_gib=40)),
    "lossless + checkpoint mmap off": config(offload=OffloadConfig(
        enabled=True, compress="lossless", checkpoint_mmap="off")),
    "lossless + AllGather over 2": config(offload=LOSSLESS, parallel=ParallelConfig(2)),
    "lossless + AllGather over 4 (SP)": config(
        offload=LOSSLESS, parallel=ParallelConfig(sequence_parallel_size=4)),
    "lossless + AllGather over 8": config(offload=LOSSLESS, parallel=ParallelConfig(8)),
    "lossless + 3 DP ranks without AllGather": config(
        offload=OffloadConfig(enabled=True, compress="lossless", use_allgather=False),
        parallel=ParallelConfig(3)),
    "fp8 resident": config(quantization="fp8"),
    "fp8 resident fp32": config(quantization="fp8", dtype="float32"),
    "fp8 + compile": config(quantization="fp8", compile="inductor"),
    "fp8 DLO": config(quantization="fp8", offload=DLO),
    "fp8 DLO + AllGather over 3": config(quantization="fp8", offload=DLO,
                                         parallel=ParallelConfig(3)),
    "fp8 DLO + resident layers": config(quantization="fp8", offload=OffloadConfig(
        enabled=True, resident_layers=1)),
    "fp8 DLO + checkpoint mmap": config(quantization="fp8", offload=OffloadConfig(
        enabled=True, checkpoint_mmap="auto")),
}
REFUSED = {
    "lossless without offload": (config(offload=OffloadConfig(compress="lossless")),
                                 "needs offload.enabled"),
    "lossless fp32": (config(offload=LOSSLESS, dtype="float32"), "dtype is float32"),
    "lossless fp16": (config(offload=LOSSLESS, dtype="float16"), "dtype is float16"),
    "lossless + runtime cache": (config(offload=OffloadConfig(
        enabled=True, compress="lossless", runtime_cache=True)), "--dlo-runtime-cache"),
    "lossless + pin limit": (config(offload=OffloadConfig(
        enabled=True, compress="lossless", pin_limit_gib=10)), "pin_limit_gib"),
    "lossless + AllGather over 3": (config(offload=LOSSLESS, parallel=ParallelConfig(3)),
                                    "group of 3"),
    "lossless + AllGather over 6 (SP)": (config(
        offload=LOSSLESS, parallel=ParallelConfig(sequence_parallel_size=6)), "group of 6"),
    "lossless + fp8": (config(offload=LOSSLESS, quantization="fp8"), "choose one"),
    "fp8 + runtime cache": (config(quantization="fp8", offload=OffloadConfig(
        enabled=True, runtime_cache=True)), "runtime cache v1"),
    "unknown quantization": (config(quantization="int4"), "quantization must be one of fp8"),
    "unknown compression": (config(offload=OffloadConfig(enabled=True, compress="zstd")),
                            "compress must be one of none, lossless"),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_accepted_combinations(name: str) -> None:
    assert problems(ACCEPTED[name]) == []


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_combinations_say_how_to_fix_them(name: str) -> None:
    cfg, expected = REFUSED[name]
    found = problems(cfg)
    assert len(found) == 1 and expected in found[0], found
    with pytest.raises(ConfigError, match="invalid engine configuration"):
        EngineConfig.from_mapping(cfg.to_mapping())


def test_flags_map_onto_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args(["--offload", "dlo", "--dlo-compress", "lossless", "--dtype",
                              "bfloat16"])
    assert engine_config_from_args(args).offload.compress == "lossless"
    args = parser.parse_args(["--quantization", "fp8"])
    assert engine_config_from_args(args).quantization == "fp8"
    with pytest.raises(ConfigError, match="choose one"):
        engine_config_from_args(parser.parse_args(
            ["--offload", "dlo", "--dlo-compress", "lossless", "--dtype", "bfloat16",
             "--quantization", "fp8"]))
    with pytest.raises(SystemExit):  # argparse refuses values outside the choices
        parser.parse_args(["--quantization", "int8"])


def test_the_rules_know_the_stripe_count_the_offload_packs_with() -> None:
    from ditserve.engine.config import PACKED_STRIPES
    from ditserve.engine.formats.packed_layout import DEFAULT_STRIPES

    assert PACKED_STRIPES == DEFAULT_STRIPES
