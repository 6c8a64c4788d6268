"""``spec.model``: where the model comes from (a node path, a PVC, or a hf:// / s3:// URI
pulled into the node cache) and what it is (family, dtype, sizes).

Owns ``ModelSpec``, reading it from the spec and the rules of ``model.uri`` (judged by
cachectl's own URI parser, the one ``cachectl pull`` applies). Called by ``spec``; pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from ditserve.cachectl.errors import UsageError
from ditserve.cachectl.model_uri import parse_model_uri
from ditserve.engine.config import MODEL_FAMILIES
from ditserve.operator import nodecache
from ditserve.operator.spec_reader import SpecReader

DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class ModelSpec:
    """A diffusers model: on the node (host_path), in a PVC (claim_name + sub_path), or pulled
    into the node cache from ``uri`` (hf:// or s3://; ``credentials_secret`` names the Secret
    whose keys become the pull's environment; ``endpoint`` / ``region`` the source's)."""

    host_path: str | None = None
    claim_name: str | None = None
    sub_path: str = ""
    uri: str | None = None
    credentials_secret: str | None = None
    endpoint: str | None = None
    region: str | None = None
    family: str = "Auto"
    dtype: str = "bfloat16"
    size_gib: float | None = None
    encoder_size_gib: float = 0.0  # text encoders' weights: pinned per rank under offload
    attention_heads: int | None = None  # the DiT's head count, if the user declares it
    checkpoint: str | None = None  # a DiT file in the volume, relative (the volume: its base)


def read_model(m: SpecReader) -> ModelSpec:
    pvc = m.child("persistentVolumeClaim")
    return ModelSpec(
        # In cachectl's form: the volume, the ensure command, node labels and status agree.
        host_path=None if (host := m.text("hostPath")) is None else nodecache.node_path(host),
        claim_name=pvc.text("claimName"),
        sub_path=pvc.text("subPath", "") or "",
        uri=m.text("uri") or None,
        credentials_secret=m.child("credentialsSecret").text("name") or None,
        endpoint=m.text("endpoint") or None,
        region=m.text("region") or None,
        family=m.text("family", "Auto", MODEL_FAMILIES),
        dtype=m.text("dtype", "bfloat16", DTYPES),
        size_gib=m.number("sizeGiB", None), encoder_size_gib=m.number("encoderSizeGiB", 0.0),
        attention_heads=m.integer("attentionHeads", None, 1),
        checkpoint=m.text("checkpoint") or None,
    )


def source_problems(m: ModelSpec, *, cache_enabled: bool) -> list[str]:
    """model.uri: a source ``cachectl pull`` accepts (its own parser), pulled into the node
    cache (so the cache must be on); the uri-only fields only with it."""
    if m.uri is None:
        extra = [name for name, v in (("credentialsSecret", m.credentials_secret),
                                      ("endpoint", m.endpoint), ("region", m.region)) if v]
        return [f"model.{n} only applies with model.uri" for n in extra]
    out = []
    try:
        parse_model_uri(m.uri)
    except UsageError as e:
        out.append(f"model.uri: {e}")
    if not cache_enabled:
        out.append("model.uri needs cache.mode NodeLocal (the model is pulled into the node cache)")
    if m.region and not m.uri.startswith("s3://"):
        out.append("model.region only applies to an s3:// model.uri")
    if m.endpoint and not m.endpoint.startswith(("http://", "https://")):
        out.append(f"model.endpoint must be an http(s) URL, got {m.endpoint!r}")
    return out
