"""The operator's error taxonomy. Every error a user can cause says how to fix it."""

from __future__ import annotations


class OperatorError(Exception):
    """Base class of every error raised on purpose by ditserve.operator."""


class InvalidSpecError(OperatorError, ValueError):
    """A DiffusionDeployment spec is invalid; the message lists every problem.

    The reconcile handler turns it into ``Ready=False, reason=InvalidSpec`` instead of retrying:
    the same spec would fail the same way until the user edits it.
    """


class KubeApiError(OperatorError):
    """The Kubernetes API answered a request with an error status."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"Kubernetes API error {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class NotLoggedInError(OperatorError):
    """The operator's API client was used before kopf's login handler produced credentials."""
