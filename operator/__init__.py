"""Kubernetes operator reconciling DiffusionDeployment objects into engine pods.

Modules, from pure to effectful: ``spec`` (CR spec -> typed values -> EngineConfig, judged by
the engine's rules), ``sizing`` (GPUs, memory, probe budgets), ``pod`` and ``render``
(desired children), ``status`` (conditions from observed objects), ``kube`` (a small async
API client), ``handlers`` (kopf glue and settings), ``main`` (the `ditserve-operator` command).
Importing this package imports nothing heavy; only ``kube``, ``handlers`` and ``main`` import kopf.
"""
