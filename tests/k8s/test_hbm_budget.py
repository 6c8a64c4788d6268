"""offload.hbmBudgetGiB: the whole pipeline's HBM budget in a DiffusionDeployment - a number
of GiB or "auto" - admitted by the CRD schema exactly when the operator's judge accepts it,
and carried into the engine config every rank reads."""

from __future__ import annotations

from typing import Any

import pytest
from k8s.crd_schema import apply_defaults, schema_errors, version_schema

from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.judge import engine_config, validate
from ditserve.operator.spec import parse_spec


def spec(budget: Any, args: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"model": {"hostPath": "/mnt/models/flux", "sizeGiB": 24},
            "offload": {"enabled": True, "useAllGather": False, "hbmBudgetGiB": budget},
            "engine": {"args": list(args)}}


def admitted(budget: Any) -> bool:
    obj = {"apiVersion": "ditserve.io/v1alpha1", "kind": "DiffusionDeployment",
           "metadata": {"name": "flux", "namespace": "default"}, "spec": spec(budget)}
    return not schema_errors(apply_defaults(version_schema(), obj))


@pytest.mark.parametrize(("budget", "engine_value"), [
    ("auto", "auto"), (24, 24.0), ("7.5", 7.5), ("0", 0.0)])
def test_a_budget_reaches_the_engine_config(budget: Any, engine_value: Any) -> None:
    assert admitted(budget)
    config = engine_config(parse_spec(spec(budget)))
    assert config.offload.hbm_budget_gib == engine_value


@pytest.mark.parametrize("budget", ["lots", "-1", "7.5GiB", "Auto", 7.5, "1e3", " 4", -2])
def test_schema_and_judge_refuse_the_same_values(budget: Any) -> None:
    assert not admitted(budget)
    with pytest.raises(InvalidSpecError, match="offload.hbmBudgetGiB must be an integer >= 0, "
                                               "a number as a string"):
        validate(spec(budget), name="flux")


def test_unset_leaves_the_engine_without_a_budget() -> None:
    data = spec(None)
    del data["offload"]["hbmBudgetGiB"]
    assert engine_config(parse_spec(data)).offload.hbm_budget_gib is None


def test_the_field_and_the_engine_flag_together_are_refused() -> None:
    with pytest.raises(InvalidSpecError, match="both set the HBM budget"):
        validate(spec("auto", ("--dlo-hbm-budget-gib", "10")), name="flux")
    # The flag alone is still an engine option (merged into the config like the others).
    data = spec(None, ("--dlo-hbm-budget-gib", "10"))
    del data["offload"]["hbmBudgetGiB"]
    assert engine_config(parse_spec(data)).offload.hbm_budget_gib == 10.0


def test_a_budget_with_allgather_is_refused_by_the_engine_rules() -> None:
    data = spec("auto")
    data["offload"]["useAllGather"] = True
    data["parallelism"] = {"data": 2}
    with pytest.raises(InvalidSpecError, match="resident layers are not supported with AllGather"):
        validate(data, name="flux")


def test_host_memory_counts_the_encoders_each_rank_pins_under_offload() -> None:
    from ditserve.operator.sizing import GIB, dlo_host_bytes, memory_bytes

    base = spec("auto")
    base["parallelism"] = {"data": 2}
    with_encoders = {**base, "model": {**base["model"], "encoderSizeGiB": 9.5}}
    assert not schema_errors(apply_defaults(version_schema(), {
        "apiVersion": "ditserve.io/v1alpha1", "kind": "DiffusionDeployment",
        "metadata": {"name": "flux", "namespace": "default"}, "spec": with_encoders}))
    without = parse_spec(base)
    assert without.model.encoder_size_gib == 0.0  # the schema's default: nothing added
    plain = dlo_host_bytes(without)
    assert plain == 2 * 24 * GIB  # rank-local DiT copies (AllGather off)
    # Two ranks, each parking (or streaming) its own 9.5 GiB of encoders.
    assert dlo_host_bytes(parse_spec(with_encoders)) == plain + 19 * GIB
    assert memory_bytes(parse_spec(with_encoders)) - memory_bytes(without) == 19 * GIB
    off = {**with_encoders, "offload": {"enabled": False}}
    assert dlo_host_bytes(parse_spec(off)) == 0  # resident serving pins nothing
