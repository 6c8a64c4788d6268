"""spec.autoscaling.scaleToZero: off by default; when on, a KEDA ScaledObject replaces the
HPA, scales the DiffusionDeployment itself from zero on the queue with activation at the first
waiting request, and the operator deletes whichever of the two the spec stopped rendering."""

from __future__ import annotations

from typing import Any

import pytest
from k8s.test_crd import admit, cr
from k8s.test_render import OWNER, children, spec_of

from ditserve.operator.children import _stale_candidates
from ditserve.operator.errors import InvalidSpecError
from ditserve.operator.spec import parse_spec

KEDA = {"enabled": True, "minReplicas": 0, "maxReplicas": 4, "targetWaitingPerReplica": 3,
        "scaleToZero": {"enabled": True,
                        "prometheusAddress": "http://prometheus-operated.monitoring:9090"}}


def test_off_by_default_and_the_hpa_stays_the_plain_autoscaler() -> None:
    plain = children(spec_of(autoscaling={"enabled": True, "maxReplicas": 4}))
    assert "HorizontalPodAutoscaler" in plain and "ScaledObject" not in plain
    assert "ScaledObject" not in children(spec_of())


def test_scale_to_zero_renders_a_scaled_object_instead_of_the_hpa() -> None:
    kids = children(spec_of(autoscaling=KEDA))
    assert "HorizontalPodAutoscaler" not in kids  # KEDA makes its own; two would fight
    so = kids["ScaledObject"]
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "ditserve.io/v1alpha1",
                                            "kind": "DiffusionDeployment", "name": "flux"}
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (0, 4)
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert meta["activationThreshold"] == "0" and meta["threshold"] == "3"
    service = kids["Service"]["metadata"]["name"]
    assert meta["query"] == (f'sum(ditserve:num_requests_waiting{{namespace="{OWNER.namespace}",'
                             f'service="{service}"}}) or vector(0)')
    assert so["metadata"]["ownerReferences"][0]["kind"] == "DiffusionDeployment"
    custom = children(spec_of(autoscaling={**KEDA, "scaleToZero": {
        **KEDA["scaleToZero"], "query": "sum(keda_interceptor_pending_requests)"}}))
    assert custom["ScaledObject"]["spec"]["triggers"][0]["metadata"]["query"] == \
        "sum(keda_interceptor_pending_requests)"


@pytest.mark.parametrize(("autoscaling", "complaint"), [
    ({**KEDA, "scaleToZero": {"enabled": True}}, "prometheusAddress is required"),
    ({"enabled": True, "minReplicas": 0, "maxReplicas": 2}, "minReplicas must be at least 1"),
])
def test_refused_without_what_it_needs(autoscaling: dict[str, Any], complaint: str) -> None:
    with pytest.raises(InvalidSpecError, match=complaint):
        parse_spec(spec_of(autoscaling=autoscaling))
    problems = admit(cr(spec_of(autoscaling=autoscaling)))
    assert len(problems) == 1 and complaint in problems[0], problems


def test_the_crd_admits_scale_to_zero() -> None:
    assert admit(cr(spec_of(autoscaling=KEDA))) == []


def test_the_child_the_spec_stopped_rendering_is_deleted() -> None:
    with_keda = _stale_candidates(OWNER, parse_spec(spec_of(autoscaling=KEDA)))
    assert any("/horizontalpodautoscalers/flux" in p for p in with_keda)
    assert not any("/scaledobjects/" in p for p in with_keda)
    with_hpa = _stale_candidates(OWNER, parse_spec(spec_of(autoscaling={**KEDA, "minReplicas": 1,
                                                                         "scaleToZero": {}})))
    assert any(p.endswith("/apis/keda.sh/v1alpha1/namespaces/models/scaledobjects/flux")
               for p in with_hpa)
