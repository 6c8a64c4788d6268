"""Local model sources for the pull tests: the local hub and moto's S3 server.

The hub-compatible HTTP server lives in ``ditserve.cachectl.local_hub`` (shared with
``bench/model_delivery.py``); this module adds the small diffusers-shaped repository the
tests pull, and moto's S3 server.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

from ditserve.cachectl.local_hub import LocalHub, Repo

__all__ = ["FILES", "LocalHub", "Repo", "moto_s3", "weights"]


def weights(size: int, seed: int = 0) -> bytes:
    return hashlib.shake_256(f"weights-{seed}".encode()).digest(size)


# A small diffusers-shaped repository: two configs (git blobs) and two "LFS" weight files.
FILES = {"model_index.json": b'{"_class_name": "FluxPipeline"}',
         "transformer/config.json": b'{"num_layers": 2}',
         "transformer/diffusion_pytorch_model.safetensors": weights(300_000),
         "vae/diffusion_pytorch_model.safetensors": weights(50_000, 1)}


@contextlib.contextmanager
def moto_s3() -> Iterator[dict[str, str]]:
    """moto's S3 in server mode on 127.0.0.1 (a real HTTP endpoint boto3 talks to); yields
    the environment a pull needs (endpoint, region, fake credentials)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield {"AWS_ENDPOINT_URL_S3": f"http://{host}:{port}", "AWS_REGION": "us-east-1",
               "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    finally:
        server.stop()
