"""spec.model.uri (hf://, s3://): the pull init container, the credentials Secret that only it
sees, the engine reading the pulled entry through the node cache, and a failed download in
the deployment's conditions and Events."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from k8s.test_render import children, env_of, pod_of
from k8s.test_status import DONE, RUNNING, conds, dd, deployment

from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.events import status_events
from ditserve.operator.spec import parse_spec
from ditserve.operator.status import compute_status

HF = {"model": {"uri": "hf://black-forest-labs/FLUX.1-dev@0ef5fff", "sizeGiB": 24,
                "credentialsSecret": {"name": "hf-token"}}}
S3 = {"model": {"uri": "s3://models/flux", "endpoint": "http://minio.storage:9000",
                "region": "eu-west-1", "credentialsSecret": {"name": "s3-keys"}}}
T0 = "2026-01-01T00:00:00Z"


@pytest.mark.parametrize("version", ["1.29.0", "1.37.0"])
@pytest.mark.parametrize("spec", [HF, S3], ids=["hf", "s3"])
def test_uri_manifests_validate(spec: dict[str, Any], version: str) -> None:
    for manifest in children(spec).values():
        kubernetes_validate.validate(manifest, version, strict=True)


def test_the_pull_runs_first_through_the_daemon_and_links_the_model() -> None:
    pod = pod_of(HF)
    pull, ensure = pod["initContainers"]
    assert pull["name"] == "cachectl-pull" and ensure["name"] == "cachectl-ensure"
    assert pull["command"][:4] == ["cachectl", "pull", "hf://black-forest-labs/FLUX.1-dev@0ef5fff",
                                   "--daemon-only"]
    assert pull["command"][pull["command"].index("--link") + 1] == "/models/model"
    # The token reaches the pull alone, never the tenant's engine image.
    assert pull["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert env_of(pull)["HF_HUB_OFFLINE"] == "0"
    engine = pod["containers"][0]
    assert "envFrom" not in engine and env_of(engine)["HF_HUB_OFFLINE"] == "1"
    # The model volume holds only the symlink; the pulled bytes live in the read-only cache.
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model"] == {"name": "model", "emptyDir": {"sizeLimit": "1Mi"}}
    mounts = {m["name"]: m for m in engine["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert mounts["cache"]["readOnly"] is True
    pull_mounts = {m["name"]: m for m in pull["volumeMounts"]}
    assert pull_mounts["cache"]["readOnly"] is True and "readOnly" not in pull_mounts["model"]
    # The ensure container builds the runtime entry of the pulled model through the daemon.
    assert ensure["command"][2:4] == ["--model", "/models/model"]
    assert ensure["command"][-1] == "--daemon-only"


def test_s3_endpoint_and_region_reach_the_pull() -> None:
    (pull, _ensure) = pod_of(S3)["initContainers"]
    env = env_of(pull)
    assert env["AWS_ENDPOINT_URL_S3"] == "http://minio.storage:9000"
    assert env["AWS_REGION"] == "eu-west-1"
    assert "HF_ENDPOINT" not in env


@pytest.mark.parametrize(("model", "said"), [
    ({"uri": "hf://just-a-name"}, "model.uri"),
    ({"uri": "hf://org/m", "region": "us-east-1"}, "model.region only applies to an s3://"),
    ({"hostPath": "/m", "endpoint": "https://hub"}, "model.endpoint only applies with model.uri"),
])
def test_the_operator_refuses_bad_uri_specs(model: dict[str, Any], said: str) -> None:
    with pytest.raises(InvalidSpecError, match=said):
        parse_spec({"model": model})


def _pod(pull_state: dict[str, Any], *, last: dict[str, Any] | None = None,
         ensure: dict[str, Any] | None = None) -> dict[str, Any]:
    statuses = [{"name": "cachectl-pull", "state": pull_state, "lastState": last or {}}]
    if ensure is not None:
        statuses.append({"name": "cachectl-ensure", "state": ensure, "lastState": {}})
    return {"metadata": {"name": "flux-0"},
            "status": {"phase": "Pending", "initContainerStatuses": statuses}}


def test_a_failed_download_reaches_the_conditions_and_an_event() -> None:
    said = ("cachectl: daemon: downloading\ncachectl: cannot pull hf://org/gone: no repository "
            "org/gone on https://huggingface.co (404)")
    failed = _pod({"waiting": {"reason": "CrashLoopBackOff"}},
                  last={"terminated": {"exitCode": 3, "message": said}})
    body = dd({**HF, "replicas": 1})
    status = compute_status(body, deployment(replicas=1, ready=0), [failed], now=T0)
    got = {c["type"]: c for c in status["conditions"]}
    assert conds(status)["CacheReady"] == ("False", "ModelDownloadFailed")
    assert conds(status)["Degraded"] == ("True", "ModelDownloadFailed")
    assert got["Ready"]["reason"] == "ModelDownloadFailed"
    assert "no repository org/gone" in got["Degraded"]["message"]
    assert "cachectl pull exited 3" in got["Degraded"]["message"]
    (event,) = status_events({}, status)
    assert (event.type, event.reason) == ("Warning", "ModelDownloadFailed")


def test_pods_pulling_or_ensuring_are_warming_and_then_ready() -> None:
    body = dd({**HF, "replicas": 2})
    pulling = compute_status(body, deployment(), [_pod(RUNNING), _pod(DONE, ensure=RUNNING)],
                             now=T0)
    assert conds(pulling)["CacheReady"] == ("False", "CacheWarming")
    assert "2 pod(s) pulling the model" in {c["type"]: c for c in pulling["conditions"]}[
        "CacheReady"]["message"]
    started = _pod(DONE, ensure=DONE)
    started["status"]["containerStatuses"] = [{"name": "engine", "state": RUNNING, "ready": True}]
    ready = compute_status(body, deployment(ready=2), [started] * 2, now=T0)
    assert conds(ready)["CacheReady"] == ("True", "CacheEntryReady")
