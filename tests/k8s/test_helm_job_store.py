"""The chart's Redis job store with a password, rendered by the real helm binary: the Redis pod
finds its password Secret in its own namespace whatever ``secretNamespaces`` lists, and the
``url`` every Secret carries gives redis-py (the engine's client) the password as written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from k8s.chart import RELEASE_NAMESPACE, by_kind, named, template

# Every character a URL's userinfo cannot hold as is (whitespace is refused by the schema).
PASSWORD = "pa/ss#w@r:d%3F?+&=[x]!"


def _redis(password: str, secret_namespaces: list[str]) -> dict[str, Any]:
    return {"jobStore": {"redis": {"enabled": True, "password": password,
                                   "secretNamespaces": secret_namespaces}}}


@pytest.fixture(scope="module")
def engines_only(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The documented use: the Secret listed for the engines' namespaces only."""
    return template(tmp_path_factory.mktemp("helm"), _redis(PASSWORD, ["ml", "ml-dev"]))


def test_the_redis_pod_finds_its_password_secret(engines_only: list[dict[str, Any]]) -> None:
    redis_pod = named(engines_only, "Deployment", "rel-ditserve-redis")
    namespace = redis_pod["metadata"]["namespace"]
    (container,) = redis_pod["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in container["env"] if e["name"] == "REDIS_PASSWORD"]
    ref = env["valueFrom"]["secretKeyRef"]
    secrets = {(s["metadata"]["namespace"], s["metadata"]["name"]): s
               for s in by_kind(engines_only, "Secret")}
    assert (namespace, ref["name"]) in secrets, "no password Secret beside the Redis pod"
    assert secrets[(namespace, ref["name"])]["stringData"][ref["key"]] == PASSWORD
    # And each listed namespace still gets its own.
    assert sorted(ns for ns, name in secrets if name == ref["name"]) == sorted(
        {RELEASE_NAMESPACE, "ml", "ml-dev"})


def test_the_release_namespace_listed_too_gets_one_secret(tmp_path: Path) -> None:
    docs = template(tmp_path, _redis("s3cret", ["ml", RELEASE_NAMESPACE]))
    assert sorted(s["metadata"]["namespace"] for s in by_kind(docs, "Secret")
                  if s["metadata"]["name"] == "rel-ditserve-job-store") == sorted(
        [RELEASE_NAMESPACE, "ml"])


def test_the_url_gives_the_engines_client_the_password(
        engines_only: list[dict[str, Any]]) -> None:
    for secret in by_kind(engines_only, "Secret"):
        url = secret["stringData"]["url"]
        # What engine/server/jobs/redis_backend.py does with it: redis.Redis.from_url.
        kwargs = redis.ConnectionPool.from_url(url).connection_kwargs
        assert kwargs["password"] == PASSWORD, url
        assert (kwargs["host"], kwargs["port"], kwargs["db"]) == (
            f"rel-ditserve-redis.{RELEASE_NAMESPACE}.svc", 6379, 0)


def test_a_password_with_whitespace_is_refused(tmp_path: Path) -> None:
    from k8s.chart import CHART, helm

    values = tmp_path / "values.yaml"
    values.write_text("jobStore: {redis: {enabled: true, password: 'a b'}}\n")
    result = helm(tmp_path, "template", "rel", str(CHART), "-f", str(values), check=False)
    assert result.returncode != 0 and "password" in result.stderr
