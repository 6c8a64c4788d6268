"""``spec.jobs``: the CRD accepts it (both copies), the operator renders the job store's URL
from its Secret into rank 0's environment (never into the ConfigMap), mounts the results
volume at /videos and writes ``server.video_dir`` / ``server.job_lease_s`` into the engine
config, and refuses the combinations the engine cannot serve: Redis without a shared results
volume, a SQLite store on a deployment of several replicas, flags spec.jobs owns. The
example with three replicas renders, and every manifest validates against Kubernetes'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from k8s.crd_schema import CHART_CRD_PATH, CRD_PATH, apply_defaults, schema_errors, version_schema
from k8s.test_render import OWNER, children, env_of, spec_of

from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.judge import judge_engine
from ditserve.operator.spec import parse_spec

EXAMPLE = Path(__file__).parents[2] / "examples" / "wan-video-replicas.yaml"
SHARED = {"redis": {"urlSecret": {"name": "job-store", "key": "url"}},
          "results": {"persistentVolumeClaim": {"claimName": "videos", "subPath": "wan"}},
          "leaseSeconds": 20}


def wan(**overrides: Any) -> dict[str, Any]:
    return spec_of(model={"hostPath": "/mnt/models/wan", "family": "Wan", "sizeGiB": 30},
                   **overrides)


def engine_and_pod(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = children(spec)["Deployment"]["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    return engine, pod


def test_shared_jobs_render_the_secret_the_volume_and_the_server_section() -> None:
    spec = wan(replicas=3, jobs=SHARED)
    engine, pod = engine_and_pod(spec)
    env = env_of(engine)
    assert env["DITSERVE_JOB_STORE"] == {"secretKeyRef": {"name": "job-store", "key": "url"}}
    # Whose jobs: <namespace>/<name> from the pod's metadata (deployments sharing one Redis
    # never take each other's jobs); the variables it names come first in the list.
    names = [e["name"] for e in engine["env"]]
    assert env["DITSERVE_JOB_NAMESPACE"] == (
        "$(DITSERVE_POD_NAMESPACE)/$(DITSERVE_JOB_NAMESPACE_NAME)")
    assert names.index("DITSERVE_JOB_NAMESPACE") > names.index("DITSERVE_POD_NAMESPACE")
    assert env["DITSERVE_JOB_NAMESPACE_NAME"] == {"fieldRef": {
        "fieldPath": "metadata.labels['app.kubernetes.io/instance']"}}
    pod_labels = children(spec)["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["app.kubernetes.io/instance"] == OWNER.name
    assert {"name": "videos", "persistentVolumeClaim": {"claimName": "videos"}} in pod["volumes"]
    assert {"name": "videos", "mountPath": "/videos", "subPath": "wan"} in engine["volumeMounts"]
    config = yaml.safe_load(children(spec)["ConfigMap"]["data"]["engine.yaml"])
    assert (config["server"]["video_dir"], config["server"]["job_lease_s"]) == ("/videos", 20)
    assert "redis" not in children(spec)["ConfigMap"]["data"]["engine.yaml"]  # no URL there
    _, server = judge_engine(parse_spec(spec))
    assert (server.video_dir, server.job_lease_s, server.job_store) == ("/videos", 20, None)


def test_without_spec_jobs_nothing_changes() -> None:
    engine, pod = engine_and_pod(wan())
    assert "DITSERVE_JOB_STORE" not in env_of(engine)
    assert "videos" not in [v["name"] for v in pod["volumes"]]


def test_one_replica_may_keep_its_jobs_in_sqlite_on_a_volume() -> None:
    jobs = {"results": {"persistentVolumeClaim": {"claimName": "videos"}}}
    engine, _ = engine_and_pod(wan(jobs=jobs))
    assert "DITSERVE_JOB_STORE" not in env_of(engine)  # the default: <video_dir>/jobs.sqlite3
    assert {"name": "videos", "mountPath": "/videos"} in engine["volumeMounts"]


S3 = {"redis": SHARED["redis"], "results": {"s3": {
    "url": "s3://videos/wan", "endpoint": "http://minio.storage:9000", "region": "eu-west-1",
    "credentialsSecret": {"name": "video-bucket"}}}}


def test_results_in_a_bucket_need_no_volume_and_reach_only_rank_0() -> None:
    engine, pod = engine_and_pod(wan(replicas=3, jobs=S3))
    env = env_of(engine)
    assert (env["DITSERVE_JOB_RESULTS"], env["AWS_ENDPOINT_URL_S3"], env["AWS_REGION"]) == (
        "s3://videos/wan", "http://minio.storage:9000", "eu-west-1")
    assert engine["envFrom"] == [{"secretRef": {"name": "video-bucket"}}]
    assert "videos" not in [v["name"] for v in pod["volumes"]]
    config = yaml.safe_load(children(wan(replicas=3, jobs=S3))["ConfigMap"]["data"][
        "engine.yaml"])
    assert "video_dir" not in config["server"]
    for manifest in children(wan(replicas=3, jobs=S3)).values():
        kubernetes_validate.validate(manifest, "1.33.0", strict=True)


@pytest.mark.parametrize(("overrides", "words"), [
    ({"jobs": {**S3, "results": {**S3["results"], **SHARED["results"]}}}, "not both"),
    ({"jobs": {**S3, "results": {"s3": {"url": "https://videos/wan"}}}}, "s3://BUCKET"),
    ({"jobs": S3, "engine": {"args": ["--job-results", "s3://other"]}},
     "must not set --job-results"),
    ({"replicas": 2, "jobs": {"results": S3["results"]}}, "may run 2 replicas"),
    ({"jobs": {"redis": SHARED["redis"]}}, "needs spec.jobs.results"),
    ({"replicas": 2, "jobs": {"results": SHARED["results"]}}, "may run 2 replicas"),
    ({"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4},
      "jobs": {"results": SHARED["results"]}}, "may run 4 replicas"),
    ({"jobs": {**SHARED, "results": {"persistentVolumeClaim": {
        "claimName": "v", "subPath": "../up"}}}}, "without '..'"),
    ({"jobs": SHARED, "engine": {"args": ["--video-dir", "/data"]}},
     "must not set --video-dir: the operator sets it from spec.jobs.results"),
    ({"jobs": SHARED, "engine": {"args": ["--job-store", "redis://other:6379/0"]}},
     "must not set --job-store"),
    ({"engine": {"env": [{"name": "DITSERVE_JOB_STORE", "value": "redis://x:6379/0"}]}},
     "spec.jobs.redis.urlSecret"),
])
def test_impossible_job_stores_are_invalid_specs(overrides: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidSpecError, match=words.replace(".", r"\.").replace("(", r"\(")):
        judge_engine(parse_spec(wan(**overrides)))


def test_the_crd_accepts_spec_jobs_and_both_copies_agree() -> None:
    assert CRD_PATH.read_text() == CHART_CRD_PATH.read_text()
    doc = {"apiVersion": "ditserve.io/v1alpha1", "kind": "DiffusionDeployment",
           "metadata": {"name": "w"}, "spec": wan(jobs=SHARED)}
    assert schema_errors(doc) == []
    defaulted = apply_defaults(version_schema(), {**doc, "spec": wan(jobs={
        "redis": {"urlSecret": {"name": "s"}}, "results": {"persistentVolumeClaim": {
            "claimName": "v"}}})})
    assert defaulted["spec"]["jobs"]["redis"]["urlSecret"]["key"] == "url"
    bad = {**doc, "spec": wan(jobs={"leaseSeconds": 0})}
    assert any("leaseSeconds" in e for e in schema_errors(bad))
    assert schema_errors({**doc, "spec": wan(jobs=S3)}) == []
    assert schema_errors({**doc, "spec": wan(jobs={"results": {"s3": {"url": "ftp://x"}}})})


def test_a_deployment_sharing_jobs_scales_on_the_shared_queue() -> None:
    auto = {"enabled": True, "minReplicas": 1, "maxReplicas": 6, "targetWaitingPerReplica": 2}
    kids = children(wan(jobs=S3, autoscaling=auto))
    (metric,) = kids["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert metric["object"]["metric"]["name"] == "ditserve_video_jobs_unfinished"
    assert metric["object"]["target"] == {"type": "AverageValue", "averageValue": "2"}
    kubernetes_validate.validate(kids["HorizontalPodAutoscaler"], "1.33.0", strict=True)
    chosen = children(wan(jobs=S3, autoscaling={**auto, "metric": "my_queue"}))
    assert chosen["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["object"]["metric"][
        "name"] == "my_queue"
    keda = children(wan(jobs=S3, autoscaling={**auto, "minReplicas": 0, "scaleToZero": {
        "enabled": True, "prometheusAddress": "http://prometheus:9090"}}))
    query = keda["ScaledObject"]["spec"]["triggers"][0]["metadata"]["query"]
    assert query.startswith("max(ditserve:video_jobs_unfinished{") and "vector(0)" in query


def test_the_replicas_example_renders_valid_manifests() -> None:
    claim, deployment = yaml.safe_load_all(EXAMPLE.read_text())
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert schema_errors(deployment) == []
    spec = apply_defaults(version_schema(), deployment)["spec"]
    kids = children(spec)
    for manifest in [claim, *kids.values()]:
        kubernetes_validate.validate(manifest, "1.33.0", strict=True)
    (engine,) = kids["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert env_of(engine)["DITSERVE_JOB_STORE"]["secretKeyRef"]["name"] == "ditserve-job-store"
    assert OWNER.name == kids["Service"]["metadata"]["name"]


def test_the_bucket_example_renders_valid_manifests_and_scales_on_the_shared_queue() -> None:
    deployment = yaml.safe_load(EXAMPLE.with_name("wan-video-s3.yaml").read_text())
    assert schema_errors(deployment) == []
    kids = children(apply_defaults(version_schema(), deployment)["spec"])
    for manifest in kids.values():
        kubernetes_validate.validate(manifest, "1.33.0", strict=True)
    (engine,) = kids["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert env_of(engine)["DITSERVE_JOB_RESULTS"] == "s3://videos/wan"
    (metric,) = kids["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert metric["object"]["metric"]["name"] == "ditserve_video_jobs_unfinished"


def test_the_crds_env_rule_names_every_variable_the_operator_sets() -> None:
    import re

    from ditserve.operator.spec import OPERATOR_ENV

    (rule,) = [line for line in CRD_PATH.read_text().splitlines()
               if "self.all(e, !(e.name in" in line]
    assert set(re.findall(r"'([A-Z_]+)'", rule)) == set(OPERATOR_ENV)
