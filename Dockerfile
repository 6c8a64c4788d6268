# The one ditserve image: the engine (`ditserve`), the node cache (`cachectl`) and the
# operator (`ditserve-operator`). The Helm chart and the operator default to it.
#
#   docker build -t ghcr.io/ditserve/ditserve:0.1.0 .
#   bash scripts/smoke-image.sh ghcr.io/ditserve/ditserve:0.1.0     # on a GPU node
#   docker push ghcr.io/ditserve/ditserve:0.1.0
#
# No model weights are baked in: engines read a diffusers directory from a volume
# (DiffusionDeployment spec.model) and never reach a model hub.

# Python 3.11 (the version the project requires and tests). PyTorch comes from PyPI at the
# version requirements.txt pins, the one every test ran with: on Linux x86_64 that wheel is
# the CUDA build (its CUDA libraries are pip packages; the driver is the node's).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="ditserve" \
      org.opencontainers.image.description="Serving diffusion transformers with continuous batching and layerwise offload" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    DITSERVE_CACHE_ROOT=/var/cache/ditserve

# `--compile` (spec.compile) uses inductor, whose GPU kernels Triton builds with the host C
# compiler; CUDA runtime base images ship none (the engine refuses --compile without one).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/ditserve
COPY pyproject.toml setup.py README.md requirements.txt ./
COPY ditserve/ ditserve/
COPY engine/ engine/
COPY cachectl/ cachectl/
COPY operator/ operator/

# Exactly the versions CI verified (torch included), then the project without re-resolving.
RUN pip install -r requirements.txt \
 && pip install --no-deps . \
 && python -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda); \
sys.exit(0 if torch.version.cuda else 'not a CUDA build of torch')"

# Non-root user uid/gid 1000: the chart's pods and the engine pods run as it, and the
# cachectl DaemonSet hands the node's cache root to it. Reuse uid 1000 if the base has one.
RUN if getent passwd 1000 >/dev/null; then \
        usermod --login ditserve --home /home/ditserve --move-home "$(getent passwd 1000 | cut -d: -f1)"; \
    else \
        groupadd --gid 1000 ditserve 2>/dev/null || true; \
        useradd --uid 1000 --gid 1000 --create-home ditserve; \
    fi \
 && mkdir -p /var/cache/ditserve \
 && chown 1000:1000 /var/cache/ditserve

USER 1000:1000
# Every entry point must start (the chart runs them as the container command).
RUN ditserve --help >/dev/null && cachectl --help >/dev/null && ditserve-operator --help >/dev/null

EXPOSE 8000
CMD ["ditserve", "serve", "--config", "/etc/ditserve/engine.yaml"]
