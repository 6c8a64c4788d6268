"""What the cluster admin allows tenants: the node paths a DiffusionDeployment may reach and the
images that may write the node cache.

Owns ``AdminPolicy``: set once by whoever installs the chart (values ``cachectl.root``,
``cachectl.modelHostPaths``, ``image``, ``imagePullSecrets``), handed to the operator as
environment variables, and applied to every spec before anything is rendered. A tenant who may
create a DiffusionDeployment chooses its image, args and env; without this policy that tenant
could mount any node directory (``model.hostPath: /var/lib/kubelet``) or point the cache at
``/etc`` and have a pod write there. With it:

- ``model.hostPath`` (and each ``loras[].hostPath``) must lie under one of ``model_roots``
  (no ``..``, no other root);
- ``cache.root`` must be the node cache root the cachectl DaemonSet serves;
- the cache init container runs ``helper_image`` (the chart's own image), never the tenant's
  ``engine.image``; engine pods mount the cache read-only (``pod``).

Called by ``judge`` (validation), ``render`` and ``deployments`` (``from_env``); pure.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass

from ditserve.operator.spec import DeploymentSpec

DEFAULT_IMAGE = "ghcr.io/ditserve/ditserve:0.1.0"
DEFAULT_MODEL_ROOTS = ("/mnt/models",)
DEFAULT_CACHE_ROOT = "/var/cache/ditserve"
# Set by the chart on the operator's container (templates/operator.yaml).
MODEL_ROOTS_ENV = "DITSERVE_MODEL_HOST_PATHS"  # comma-separated absolute directories
CACHE_ROOT_ENV = "DITSERVE_NODE_CACHE_ROOT"
ENGINE_IMAGE_ENV = "DITSERVE_ENGINE_IMAGE"  # engine pods that name no engine.image
HELPER_IMAGE_ENV = "DITSERVE_IMAGE"  # the chart's image: runs the cache init container
PULL_SECRETS_ENV = "DITSERVE_IMAGE_PULL_SECRETS"  # comma-separated Secret names


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(part.strip() for part in (text or "").split(",") if part.strip())


def _clean(path: str) -> str:
    return posixpath.normpath(path) if path.startswith("/") else path


@dataclass(frozen=True)
class AdminPolicy:
    """The admin's roots and images; the defaults are the chart's default values."""

    model_roots: tuple[str, ...] = DEFAULT_MODEL_ROOTS
    cache_root: str = DEFAULT_CACHE_ROOT
    engine_image: str = DEFAULT_IMAGE
    helper_image: str = DEFAULT_IMAGE
    pull_secrets: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> AdminPolicy:
        """The policy the chart set on the operator (unset variables keep the defaults; an
        empty model-roots list is the admin's: no node directory is allowed, only PVCs)."""
        listed = environ.get(MODEL_ROOTS_ENV)
        roots = DEFAULT_MODEL_ROOTS if listed is None else _names(listed)
        engine = environ.get(ENGINE_IMAGE_ENV) or DEFAULT_IMAGE
        return cls(model_roots=tuple(_clean(r) for r in roots),
                   cache_root=_clean(environ.get(CACHE_ROOT_ENV) or DEFAULT_CACHE_ROOT),
                   engine_image=engine,
                   helper_image=environ.get(HELPER_IMAGE_ENV) or engine,
                   pull_secrets=_names(environ.get(PULL_SECRETS_ENV)))

    def _roots(self) -> str:
        return ", ".join(self.model_roots) or "none: models come from PVCs or model.uri"

    def allows_model_path(self, path: str) -> bool:
        if not path.startswith("/") or ".." in path.split("/"):
            return False
        clean = _clean(path)
        return any(clean == root or clean.startswith(root.rstrip("/") + "/")
                   for root in self.model_roots)

    def problems(self, spec: DeploymentSpec) -> list[str]:
        """Why the admin does not allow this spec (empty if it does)."""
        out = []
        host_path = spec.model.host_path
        if host_path is not None and not self.allows_model_path(host_path):
            out.append(f"model.hostPath {host_path!r} is outside the node directories the "
                       f"cluster admin allows for models ({self._roots()}; chart "
                       "value cachectl.modelHostPaths): put the model under one of them, or use "
                       "model.persistentVolumeClaim")
        for lora in spec.loras:  # adapters' node paths: the same roots as models
            if lora.host_path is not None and not self.allows_model_path(lora.host_path):
                out.append(f"loras[{lora.name}].hostPath {lora.host_path!r} is outside the node "
                           f"directories the cluster admin allows ({self._roots()}"
                           "; chart value cachectl.modelHostPaths): put it under one of them, "
                           "or use a persistentVolumeClaim")
        if spec.cache.enabled and spec.cache.root is not None \
                and _clean(spec.cache.root) != self.cache_root:
            out.append(f"cache.root {spec.cache.root!r} is not the node cache root "
                       f"{self.cache_root!r} (chart value cachectl.root): leave cache.root "
                       "unset or set it to that root, or set cache.mode: None")
        return out

    def resolve(self, spec: DeploymentSpec) -> DeploymentSpec:
        """The spec with the admin's values filled in where the tenant left them unset."""
        if spec.cache.root is not None:
            return spec
        return dataclasses.replace(spec, cache=dataclasses.replace(spec.cache,
                                                                   root=self.cache_root))

    def engine_pull_secrets(self, spec: DeploymentSpec) -> tuple[str, ...]:
        """The pull secrets of an engine pod: the tenant's own, plus the chart's when the pod
        runs the chart's images (the engine image by default, the cache init container)."""
        chart_image = spec.engine.image is None or (spec.cache.enabled and bool(self.pull_secrets))
        extra = self.pull_secrets if chart_image else ()
        return tuple(dict.fromkeys((*spec.engine.image_pull_secrets, *extra)))
