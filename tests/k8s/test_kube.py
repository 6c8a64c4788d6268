"""The operator's small API client: URL building, and its verbs against the emulator."""

from __future__ import annotations

import kopf
import pytest
from k8s.k8s_emulator import CONFIGMAPS, Emulator

from ditserve.operator.errors import KubeApiError, NotLoggedInError
from ditserve.operator.kube import KubeClient, manifest_path, resource_path


def test_paths() -> None:
    assert resource_path("v1", "pods", "ml") == "/api/v1/namespaces/ml/pods"
    assert resource_path("apps/v1", "deployments", "ml", "flux") == (
        "/apis/apps/v1/namespaces/ml/deployments/flux")
    assert resource_path("ditserve.io/v1alpha1", "diffusiondeployments", "ml", "f", "status") == (
        "/apis/ditserve.io/v1alpha1/namespaces/ml/diffusiondeployments/f/status")
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ml"}}
    assert manifest_path(cm) == "/api/v1/namespaces/ml/configmaps/c"
    assert manifest_path(cm, named=False) == "/api/v1/namespaces/ml/configmaps"


async def test_requests_before_login_say_so() -> None:
    with pytest.raises(NotLoggedInError):
        await KubeClient().get("/api/v1/namespaces/default/pods/x")


@pytest.mark.kmock(cls=Emulator)
async def test_create_apply_delete_and_errors_are_typed(kmock: Emulator) -> None:
    client = KubeClient()
    client.login(kopf.ConnectionInfo(server=str(kmock.url)))
    try:
        cm = {"apiVersion": "v1", "kind": "ConfigMap",
              "metadata": {"name": "c", "namespace": "default"}, "data": {"a": "1"}}
        created = await client.create(cm)
        assert created["data"] == {"a": "1"} and created["metadata"]["uid"]
        with pytest.raises(KubeApiError) as info:  # never a takeover of an existing object
            await client.create(cm)
        assert info.value.status == 409
        rv = created["metadata"]["resourceVersion"]
        updated = await client.apply({**cm, "data": {"a": "2"}}, resource_version=rv)
        assert updated is not None and updated["metadata"]["uid"] == created["metadata"]["uid"]
        assert kmock.objects[CONFIGMAPS, "default", "c"].raw["data"] == {"a": "2"}
        with pytest.raises(KubeApiError) as info:  # applied under a stale resourceVersion
            await client.apply({**cm, "data": {"a": "3"}}, resource_version=rv)
        assert info.value.status == 409
        assert kmock.objects[CONFIGMAPS, "default", "c"].raw["data"] == {"a": "2"}
        path = manifest_path(cm)
        with pytest.raises(KubeApiError) as info:  # the uid precondition protects others' objects
            await client.delete(path, uid="someone-else")
        assert info.value.status == 409 and await client.get(path) is not None
        await client.delete(path, uid=created["metadata"]["uid"])
        assert await client.get(path) is None
        await client.create(cm)
        assert await client.get(manifest_path({**cm, "metadata": {"name": "nope",
                                                                  "namespace": "default"}})) is None
        items = await client.list("/api/v1/namespaces/default/configmaps")
        assert [i["metadata"]["name"] for i in items] == ["c"]
        with pytest.raises(KubeApiError) as info:
            await client.list("/apis/example.dev/v1/namespaces/default/widgets")
        assert info.value.status == 404
    finally:
        await client.close()


@pytest.mark.kmock(cls=Emulator)
async def test_conditional_status_patch_conflicts_when_stale(kmock: Emulator) -> None:
    from k8s.k8s_emulator import DD

    client = KubeClient()
    client.login(kopf.ConnectionInfo(server=str(kmock.url)))
    path = "/apis/ditserve.io/v1alpha1/namespaces/default/diffusiondeployments"
    body = {"apiVersion": "ditserve.io/v1alpha1", "kind": "DiffusionDeployment",
            "metadata": {"name": "f", "namespace": "default"},
            "spec": {"model": {"hostPath": "/mnt/models/m"}}}
    try:
        created = await client.create(body)
        rv = created["metadata"]["resourceVersion"]
        await client.patch_status(f"{path}/f", {"replicas": 1}, resource_version=rv)
        with pytest.raises(KubeApiError) as info:  # rv moved on with the first write
            await client.patch_status(f"{path}/f", {"replicas": 2}, resource_version=rv)
        assert info.value.status == 409
        assert kmock.objects[DD, "default", "f"].raw["status"] == {"replicas": 1}
        # The emulator admits CRs like an API server: defaults filled in, schema enforced.
        assert kmock.objects[DD, "default", "f"].raw["spec"]["parallelism"] == {
            "data": 1, "sequence": 1, "gpusPerNode": 8}
        with pytest.raises(KubeApiError) as info:
            await client.create({**body, "metadata": {"name": "g", "namespace": "default"},
                                "spec": {"model": {"hostPath": "/mnt/models/m"}, "replicas": -1}})
        assert info.value.status == 422 and "spec.replicas" in info.value.message
    finally:
        await client.close()


class _RacingClient:
    """Answers like an API server whose owner object changes once between read and write."""

    def __init__(self) -> None:
        self.rv = 1
        self.patches: list[tuple[str, dict, str | None]] = []

    async def get(self, path: str) -> dict | None:
        if "/deployments/" in path:
            return None
        return {"metadata": {"name": "f", "namespace": "default", "generation": 1,
                             "resourceVersion": str(self.rv), "uid": "u"},
                "spec": {"model": {"hostPath": "/mnt/models/m"}}, "status": {}}

    async def list(self, path: str, *, label_selector: str | None = None,
                   field_selector: str | None = None) -> list[dict]:
        return []

    async def patch_status(self, path: str, status: dict, *,
                           resource_version: str | None = None) -> dict:
        self.patches.append((path, status, resource_version))
        if len(self.patches) == 1:
            self.rv += 1  # another writer got there first
            raise KubeApiError(409, "Conflict", "the object has been modified")
        return {}


async def test_status_writes_are_redone_from_a_fresh_read_on_conflict() -> None:
    from ditserve.operator.deployments import _sync_status
    from ditserve.operator.policy import AdminPolicy

    client = _RacingClient()
    await _sync_status(client, {"apply_failures": {}, "policy": AdminPolicy(), "repairs": {}},
                       "default", "f")  # type: ignore[arg-type]
    assert [rv for _, _, rv in client.patches] == ["1", "2"]
    path, status, _ = client.patches[-1]
    assert path.endswith("/diffusiondeployments/f")
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Ready"] == "ChildrenMissing"
