"""Every kopf handler of the operator, registered by importing this module.

``deployments``: DiffusionDeployments and the settings; ``child_handlers``: their children,
pods and mount failures (drift repair, status refreshes); ``node_handlers``: the
per-node NodeCache objects (summaries and node labels). Loaded by ``main``
(``ditserve-operator``) or directly: ``kopf run -m ditserve.operator.handlers``.
"""

from ditserve.operator import child_handlers, deployments, node_handlers

__all__ = ["child_handlers", "deployments", "node_handlers"]
