"""Every kopf handler of the operator, registered by importing this module.

``deployments``: DiffusionDeployments, their children and pods; ``node_handlers``: the
per-node NodeCache objects (summaries and node labels). Loaded by ``main``
(``ditserve-operator``) or directly: ``kopf run -m ditserve.operator.handlers``.
"""

from ditserve.operator import deployments, node_handlers

__all__ = ["deployments", "node_handlers"]
