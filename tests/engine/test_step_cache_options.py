"""Step-cache options at the edges: the spec's parsing and refusals, the engine config
section and flags, and `ditserve generate --step-cache` printing what it skipped."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ditserve.engine.cli.main import build_parser, main
from ditserve.engine.config import EngineConfig
from ditserve.engine.config.flags import engine_config_from_args
from ditserve.engine.config.step_cache import StepCacheSpec, parse_step_cache
from ditserve.engine.errors import ConfigError, InvalidRequestError
from ditserve.engine.request import SamplingParams


def test_spec_parses_objects_names_and_every_k() -> None:
    assert parse_step_cache(None) is None
    assert parse_step_cache("teacache") == StepCacheSpec("teacache")
    assert parse_step_cache("every=3") == StepCacheSpec("every", every=3)
    assert parse_step_cache({"policy": "first-block", "threshold": 0.1}) == \
        StepCacheSpec("first-block", threshold=0.1)
    assert parse_step_cache({"policy": "none"}).never_reuses  # type: ignore[union-attr]
    assert StepCacheSpec("first-block", threshold=0).never_reuses
    assert StepCacheSpec("every", every=1).never_reuses
    assert not StepCacheSpec("every").never_reuses


@pytest.mark.parametrize(("value", "message"), [
    ({"policy": "sometimes"}, "policy must be one of first-block, teacache, every or 'none'"),
    ({"threshold": 0.1}, "policy is required"),
    ({"policy": "every", "threshold": 0.1}, "threshold applies to first-block and teacache"),
    ({"policy": "first-block", "every": 2}, "every applies to the 'every' policy"),
    ({"policy": "first-block", "threshold": -1}, "threshold must be a number in [0, 10]"),
    ({"policy": "every", "every": 0}, "every must be an integer in [1, 100]"),
    ({"policy": "every", "k": 2}, "unknown key(s) k"),
    ("first-block=2", "only 'every=K' takes a value"),
    (3, "must be an object"),
])
def test_spec_refusals_name_the_fix(value: object, message: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        parse_step_cache(value)
    assert e.value.field == "step_cache" and message in e.value.message


def test_sampling_params_validate_their_step_cache() -> None:
    bad = SamplingParams(prompt="p", step_cache=StepCacheSpec("every", every=0))
    with pytest.raises(InvalidRequestError, match="every must be an integer"):
        bad.validate()
    # Per row, so not part of the batch key: cached and uncached requests share forwards.
    cached = SamplingParams(prompt="p", step_cache=StepCacheSpec("every"))
    assert cached.batch_key() == SamplingParams(prompt="q").batch_key()


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["generate", "--prompt", "p", *argv])


def test_flags_and_config_file_set_the_server_default() -> None:
    config = engine_config_from_args(parse("--step-cache", "every", "--step-cache-every", "3"))
    assert config.step_cache.spec() == StepCacheSpec("every", every=3)
    config = engine_config_from_args(parse("--step-cache-threshold", "0.2"),
                                     {"step_cache": {"policy": "first-block"}})
    assert config.step_cache.spec() == StepCacheSpec("first-block", threshold=0.2)
    assert EngineConfig.from_mapping(config.to_mapping()) == config
    assert EngineConfig().step_cache.spec() is None  # off by default


@pytest.mark.parametrize(("argv", "base", "message"), [
    (("--step-cache-every", "3"), None, "need step_cache.policy"),
    (("--step-cache", "every", "--step-cache-threshold", "0.1"), None,
     "threshold applies to first-block and teacache"),
    (("--step-cache", "first-block", "--sequence-parallel-size", "2"), None,
     "step_cache needs sequence_parallel_size 1"),
    ((), {"step_cache": {"policy": "often"}}, "step_cache.policy must be one of"),
])
def test_invalid_step_cache_options_are_config_errors(argv, base, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=message):
        engine_config_from_args(parse(*argv), base)


def test_generate_prints_what_the_step_cache_skipped(tiny_model_dir, tmp_path: Path,
                                                     capsys) -> None:  # type: ignore[no-untyped-def]
    code = main(["generate", "--model", str(tiny_model_dir), "--device", "cpu", "--prompt", "a cat",
                 "--steps", "8", "--seed", "3", "--out", str(tmp_path / "cat.png"),
                 "--step-cache", "every", "--offload", "dlo"])
    assert code == 0
    out = capsys.readouterr().out
    # 8 steps, every 2: steps 3 and 5 reuse all 5 blocks of the tiny Flux (2 + 3).
    assert "step cache: skipped 10 of 40 block computations (25%)" in out
    assert "GiB of streamed weights not copied" in out
