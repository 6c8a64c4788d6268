"""render(spec) for the platform: replicas across nodes (LeaderWorkerSet and its launcher), pod
identity and metadata, disruption budgets, the cached-node preference, and the restricted Pod
Security level of the PVC modes. Every manifest is valid for its schema."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from k8s.test_render import (
    VARIANTS,
    _violates_restricted,
    children,
    env_of,
    mebi,
    pod_of,
    spec_of,
)

from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.render import CONFIG_HASH_ANNOTATION, selector_labels
from ditserve.operator.spec import parse_spec

MULTI_NODE = spec_of(parallelism={"data": 16, "gpusPerNode": 8}, replicas=2,
                     offload={"enabled": True, "runtimeCache": {"enabled": True}},
                     engine={"args": ["--log-level", "debug"],
                             "apiKeySecret": {"name": "flux-key"}})


def test_a_replica_larger_than_a_node_is_a_leader_worker_set() -> None:
    from k8s import k8s_schemas

    kids = children(MULTI_NODE)
    assert "Deployment" not in kids
    lws = kids["LeaderWorkerSet"]
    k8s_schemas.validate(lws)  # the vendored LWS schema; pod templates as core PodTemplateSpecs
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["name"] == "flux-lws"  # not the Service's name: LWS makes its own
    assert lws["spec"]["replicas"] == 2
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = group["leaderTemplate"]["spec"]["containers"][0]
    worker = group["workerTemplate"]["spec"]["containers"][0]
    for container in (leader, worker):
        env = env_of(container)
        assert env["MASTER_ADDR"] == "$(LWS_LEADER_ADDRESS)"  # injected ahead of ours by LWS
        assert env["NODE_RANK"] == "$(LWS_WORKER_INDEX)"
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["MASTER_PORT"]) == ("16", "8",
                                                                                     "29500")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert container["command"][:2] == ["sh", "-c"]
        assert container["args"] == ["--log-level", "debug"]
    # Only rank 0 serves HTTP: probes, the port and the API key are the leader's.
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "readinessProbe" not in worker and "ports" not in worker
    assert "DITSERVE_API_KEY" in env_of(leader) and "DITSERVE_API_KEY" not in env_of(worker)
    assert kids["Service"]["spec"]["selector"] == {
        **selector_labels("flux"), "leaderworkerset.sigs.k8s.io/worker-index": "0"}
    # Host memory per pod: AllGather over DP 16, 8 ranks per pod -> half the model per pod.
    memory = leader["resources"]["limits"]["memory"]
    assert memory == mebi(16 + 12 + 8)
    config = yaml.safe_load(kids["ConfigMap"]["data"]["engine.yaml"])
    assert config["parallel"]["data_parallel_size"] == 16


def _fake_ditserve(tmp_path: Any, exit_code: int) -> Any:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "ditserve"
    fake.write_text('#!/bin/sh\necho "$1 rank=$RANK local=$LOCAL_RANK args=$*" >> "$RECORD"\n'
                    f"exit {exit_code}\n")
    fake.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize(("node_rank", "exit_code", "expected"), [
    ("0", 0, {"serve rank=0 local=0", "worker rank=1 local=1", "worker rank=2 local=2",
              "worker rank=3 local=3"}),
    ("1", 0, {"worker rank=4 local=0", "worker rank=5 local=1", "worker rank=6 local=2",
              "worker rank=7 local=3"}),
    ("1", 3, {"worker rank=4 local=0", "worker rank=5 local=1", "worker rank=6 local=2",
              "worker rank=7 local=3"}),
])
def test_the_launcher_starts_one_rank_per_gpu(tmp_path: Any, node_rank: str, exit_code: int,
                                              expected: set[str]) -> None:
    """The launcher of a multi-node pod, run by the container's own command line with a
    stand-in `ditserve`: the ranks it starts, what each is given, and the pod's exit status
    (a rank's, so the LeaderWorkerSet restarts the group when one fails)."""
    import os
    import subprocess

    from ditserve.engine.cli.main import build_parser

    spec = spec_of(parallelism={"data": 8, "gpusPerNode": 4})
    (container,) = children(spec)["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"][
        "workerTemplate"]["spec"]["containers"]
    record = tmp_path / "record"
    env = {"PATH": f"{_fake_ditserve(tmp_path, exit_code)}:{os.defpath}", "RECORD": str(record),
           "NODE_RANK": node_rank, "LOCAL_WORLD_SIZE": env_of(container)["LOCAL_WORLD_SIZE"]}
    # capture_output: run() then reads to EOF, which every background rank holds open until it
    # exits, so all ranks have recorded themselves when it returns.
    done = subprocess.run([*container["command"], "--log-level", "debug"], env=env, timeout=30,
                          capture_output=True)
    if node_rank != "0":  # rank 0's pod is `ditserve serve` itself (exec): its own status
        assert done.returncode == exit_code, done.stderr
    lines = record.read_text().splitlines()
    assert {line.split(" args=")[0] for line in lines} == expected
    for line in lines:  # every rank reads the config file; only rank 0 gets engine.args
        args = build_parser().parse_args(line.split(" args=")[1].split())  # the real parser
        assert args.command == line.split()[0] and str(args.config) == "/etc/ditserve/engine.yaml"
        assert ("--log-level debug" in line) == (args.command == "serve")


def test_pod_identity_labels_annotations_and_pull_secrets() -> None:
    spec = spec_of(engine={"imagePullSecrets": [{"name": "regcred"}], "serviceAccountName": "flux",
                           "podLabels": {"team": "ml"}, "podAnnotations": {"sidecar": "off"}})
    template = children(spec)["Deployment"]["spec"]["template"]
    assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert template["spec"]["serviceAccountName"] == "flux"
    assert template["spec"]["automountServiceAccountToken"] is False
    assert template["metadata"]["labels"]["team"] == "ml"
    assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == "flux"
    assert template["metadata"]["annotations"]["sidecar"] == "off"
    assert CONFIG_HASH_ANNOTATION in template["metadata"]["annotations"]
    with pytest.raises(InvalidSpecError, match="must not set 'app.kubernetes.io/name'"):
        parse_spec(spec_of(engine={"podLabels": {"app.kubernetes.io/name": "x"}}))
    with pytest.raises(InvalidSpecError, match="podLabels value 'not ok'"):
        parse_spec(spec_of(engine={"podLabels": {"team": "not ok"}}))


@pytest.mark.parametrize(("overrides", "wanted"), [
    ({}, False), ({"replicas": 3}, True), ({"replicas": 3, "podDisruptionBudget": {
        "enabled": False}}, False), ({"podDisruptionBudget": {"enabled": True}}, True)])
def test_disruption_budget_by_default_for_several_replicas(overrides: dict[str, Any],
                                                           wanted: bool) -> None:
    kids = children(spec_of(**overrides))
    assert ("PodDisruptionBudget" in kids) == wanted
    if wanted:
        pdb = kids["PodDisruptionBudget"]
        assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(
            "flux")}}


def test_engine_pods_prefer_nodes_with_a_ready_cache_entry() -> None:
    from ditserve.operator.nodecache import cache_label_key

    user = VARIANTS["pvc-restricted"]["scheduling"]["affinity"]
    pod = pod_of(spec_of(scheduling={"affinity": user}))
    node = pod["affinity"]["nodeAffinity"]
    assert node["requiredDuringSchedulingIgnoredDuringExecution"] == user["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]  # the user's terms stay
    (term,) = node["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["preference"]["matchExpressions"] == [
        {"key": cache_label_key("/mnt/models/flux", "bfloat16"), "operator": "In",
         "values": ["Ready"]}]
    # No daemon entries for PVC models, no cache, or when asked not to: no preference.
    assert "nodeAffinity" not in pod_of(spec_of(cache={"mode": "None"}))["affinity"]
    assert "nodeAffinity" not in pod_of(spec_of(scheduling={"preferCachedNodes": False}))[
        "affinity"]
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in pod_of(
        VARIANTS["pvc-restricted"])["affinity"]["nodeAffinity"]


def test_pvc_modes_meet_the_restricted_level_on_one_node_and_across_nodes() -> None:
    pvc = VARIANTS["pvc-restricted"]
    multi = {**pvc, "parallelism": {"data": 16}}
    group = children(multi)["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    for template in (group["leaderTemplate"], group["workerTemplate"]):
        assert _violates_restricted(template["spec"]) == []
    no_cache = {**pvc, "cache": {"mode": "None"}}
    assert _violates_restricted(pod_of(no_cache)) == []
