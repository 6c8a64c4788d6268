"""ditserve: serving large diffusion transformers on Kubernetes.

Subpackages: ``ditserve.engine`` (step-wise engine, offload, HTTP API),
``ditserve.cachectl`` (node-local weight cache), ``ditserve.operator`` (kopf operator).
"""

__version__ = "0.1.0"
