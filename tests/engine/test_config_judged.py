"""The rules run once per config (``engine.config.judged``): a config the CLI's
``from_mapping`` judged is not judged again by the engine, nor its offload options by the
offload backend; a new config object (a ``replace``) is judged on its own."""

from __future__ import annotations

import dataclasses

import pytest

from ditserve.engine.config import EngineConfig, OffloadConfig, judged, rules, validate
from ditserve.engine.errors import ConfigError


@pytest.fixture
def judgements(monkeypatch: pytest.MonkeyPatch) -> list[EngineConfig]:
    """Every config the rules judge, in order."""
    seen: list[EngineConfig] = []
    problems = rules.problems

    def counted(config: EngineConfig) -> list[str]:
        seen.append(config)
        return problems(config)

    monkeypatch.setattr(rules, "problems", counted)
    return seen


def test_a_config_from_a_mapping_is_judged_once(judgements: list[EngineConfig]) -> None:
    config = EngineConfig.from_mapping({"offload": {"enabled": True}})
    assert validate(config) is config  # the engine's own validate: nothing to judge again
    assert judgements == [config]
    assert judged(config) and judged(config.offload)


def test_a_new_config_is_judged_on_its_own(judgements: list[EngineConfig]) -> None:
    config = validate(EngineConfig())
    changed = validate(dataclasses.replace(config, offload=OffloadConfig(enabled=True)))
    assert judgements == [config, changed]
    assert not judged(OffloadConfig(enabled=True))  # an equal but unjudged object


def test_a_bad_config_is_refused_every_time() -> None:
    bad = EngineConfig(offload=OffloadConfig(slots=4))  # slots without offload
    for _ in range(2):
        with pytest.raises(ConfigError, match="only apply with offload enabled"):
            validate(bad)
    assert not judged(bad)
