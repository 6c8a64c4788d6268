"""A video job as the JSON text a job backend keeps (``encode_job`` / ``decode_job``).

Every replica must read every job - its request included, since the replica that claims a
job runs it from this record alone - so the whole ``VideoJob`` round-trips: the sampling
parameters (conditioning images and references as zlib-compressed, base64 bytes; LoRA references as
their names, files and scales, which every replica of a deployment resolves alike), the
status, the lease and the result. Called by the SQLite and Redis backends only.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import zlib
from typing import Any

from ditserve.engine.condition_image import ConditionImage
from ditserve.engine.config.step_cache import StepCacheSpec
from ditserve.engine.reference_media import Reference, ReferenceAudio, ReferenceVideo
from ditserve.engine.request import LoraRef, SamplingParams
from ditserve.engine.server.jobs.model import JobStatus, VideoJob, VideoSpec

SCHEMA = 1  # bumped when a record's fields change meaning; older records are refused


def encode_job(job: VideoJob) -> str:
    fields = {f.name: getattr(job, f.name) for f in dataclasses.fields(job)}
    fields.update(
        status=job.status.name,
        spec={"fps": job.spec.fps, "model": job.spec.model,
              "params": _encode_params(job.spec.params)})
    return json.dumps({"schema": SCHEMA, **fields}, separators=(",", ":"))


def decode_job(text: str | bytes) -> VideoJob:
    data: dict[str, Any] = json.loads(text)
    if data.pop("schema", None) != SCHEMA:
        raise ValueError("a job record of another ditserve version (record schema "
                         f"{data.get('schema')!r}, this server reads {SCHEMA})")
    spec = data.pop("spec")
    data["spec"] = VideoSpec(params=_decode_params(spec["params"]), fps=spec["fps"],
                             model=spec["model"])
    data["status"] = JobStatus[data["status"]]
    return VideoJob(**data)


def _encode_params(params: SamplingParams) -> dict[str, Any]:
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    out["images"] = [{"width": i.width, "height": i.height,
                      "rgb": base64.b64encode(zlib.compress(i.rgb, 1)).decode("ascii")}
                     for i in params.images]
    out["loras"] = [dataclasses.asdict(lora) for lora in params.loras]
    out["references"] = [_encode_reference(r) for r in params.references]
    out["step_cache"] = (dataclasses.asdict(params.step_cache)
                         if params.step_cache is not None else None)
    return out


def _packed(data: bytes) -> str:
    return base64.b64encode(zlib.compress(data, 1)).decode("ascii")


def _unpacked(text: str) -> bytes:
    return zlib.decompress(base64.b64decode(text))


def _encode_reference(reference: Reference) -> dict[str, Any]:
    if isinstance(reference, ConditionImage):
        return {"kind": "image", "width": reference.width, "height": reference.height,
                "rgb": _packed(reference.rgb)}
    if isinstance(reference, ReferenceVideo):  # the file as sent (compressed already)
        return {"kind": "video", "file": base64.b64encode(reference.data).decode("ascii"),
                "width": reference.width, "height": reference.height,
                "count": reference.count, "fps": reference.fps,
                "audio_rate": reference.audio_rate, "audio_channels": reference.audio_channels}
    return {"kind": "audio", "sample_rate": reference.sample_rate,
            "channels": reference.channels, "samples": _packed(reference.samples)}


def _decode_reference(data: dict[str, Any]) -> Reference:
    if data["kind"] == "image":
        return ConditionImage(data["width"], data["height"], _unpacked(data["rgb"]))
    if data["kind"] == "video":
        return ReferenceVideo(base64.b64decode(data["file"]), data["width"], data["height"],
                              data["count"], data["fps"], data["audio_rate"],
                              data["audio_channels"])
    return ReferenceAudio(data["sample_rate"], data["channels"], _unpacked(data["samples"]))


def _decode_params(data: dict[str, Any]) -> SamplingParams:
    values = dict(data)
    values["images"] = tuple(
        ConditionImage(i["width"], i["height"], zlib.decompress(base64.b64decode(i["rgb"])))
        for i in data["images"])
    values["loras"] = tuple(LoraRef(**lora) for lora in data["loras"])
    values["references"] = tuple(_decode_reference(r) for r in data.get("references", ()))
    cache = data["step_cache"]
    values["step_cache"] = StepCacheSpec(**cache) if cache is not None else None
    return SamplingParams(**values)
