"""spec.scheduling's request policy (issue 38): read from the CR, rendered into the engine's
config file, judged by the engine's rules, and a managed flag in engine.args."""

from __future__ import annotations

import pytest
import yaml

from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.judge import validate
from ditserve.operator.render import Owner, render
from ditserve.operator.spec import parse_spec

BASE = {"model": {"hostPath": "/mnt/models/m"}}
OWNER = Owner(name="demo", namespace="ns", uid="0b9e7b5c-1111-2222-3333-444455556666",
              generation=1)


def engine_file(spec: dict) -> dict:  # type: ignore[type-arg]
    [configmap] = [m for m in render(parse_spec(spec), OWNER)
                   if m["kind"] == "ConfigMap"]
    [text] = configmap["data"].values()
    return yaml.safe_load(text)  # type: ignore[no-any-return]


def test_the_policy_is_fcfs_by_default_and_rendered_when_set() -> None:
    assert validate(BASE)[1].scheduler.scheduling_policy == "fcfs"
    spec = {**BASE, "scheduling": {"policy": "priority", "agingSeconds": 12.5,
                                   "maxPreemptions": 1, "nodeSelector": {"gpu": "h200"}}}
    _, config = validate(spec)
    assert (config.scheduler.scheduling_policy, config.scheduler.aging_s,
            config.scheduler.max_preemptions) == ("priority", 12.5, 1)
    rendered = engine_file(spec)["scheduler"]
    assert (rendered["scheduling_policy"], rendered["aging_s"],
            rendered["max_preemptions"]) == ("priority", 12.5, 1)


def test_a_bad_policy_is_an_invalid_spec_and_the_flag_is_managed() -> None:
    with pytest.raises(InvalidSpecError, match="spec.scheduling.policy must be one of fcfs, "
                                               "priority"):
        validate({**BASE, "scheduling": {"policy": "lifo"}})
    with pytest.raises(InvalidSpecError, match="aging_s"):
        validate({**BASE, "scheduling": {"agingSeconds": 0}})
    with pytest.raises(InvalidSpecError, match="--scheduling-policy.*scheduling.policy"):
        validate({**BASE, "engine": {"args": ["--scheduling-policy", "priority"]}})


def test_the_autoscaler_can_target_the_high_priority_queue() -> None:
    spec = {**BASE, "scheduling": {"policy": "priority"},
            "autoscaling": {"enabled": True, "maxReplicas": 4,
                            "metric": "ditserve_num_requests_waiting_high_priority"}}
    [hpa] = [m for m in render(parse_spec(spec), OWNER)
             if m["kind"] == "HorizontalPodAutoscaler"]
    [metric] = hpa["spec"]["metrics"]
    assert metric["object"]["metric"]["name"] == "ditserve_num_requests_waiting_high_priority"
    assert engine_file(spec)["scheduler"]["scheduling_policy"] == "priority"
