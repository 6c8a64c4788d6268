"""A video job as the JSON text a job backend keeps (``encode_job`` / ``decode_job``).

Every replica must read every job - its request included, since the replica that claims a
job runs it from this record alone - so the whole ``VideoJob`` round-trips: the sampling
parameters (conditioning images and references as zlib-compressed, base64 bytes; LoRA references as
their names, files and scales, which every replica of a deployment resolves alike), the
status, the lease and the result. Called by the SQLite and Redis backends only.

A job's record is read and written again at every change (each step's progress, the lease's
renewals), but its media never change: ``_Packing`` remembers the last media it packed or
unpacked, so a change rewrites the record without compressing a large reference again (a
3000x2000 input_reference is 18 MB of RGB: ~0.2 s of zlib per change otherwise). A finished
job keeps no media at all (``JobStore`` drops them: nothing runs it again).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import threading
import zlib
from collections import OrderedDict
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
    out["images"] = [{"width": i.width, "height": i.height, "rgb": _packed(i.rgb)}
                     for i in params.images]
    out["loras"] = [dataclasses.asdict(lora) for lora in params.loras]
    out["references"] = [_encode_reference(r) for r in params.references]
    out["step_cache"] = (dataclasses.asdict(params.step_cache)
                         if params.step_cache is not None else None)
    return out


class _Packing:
    """Media bytes <-> their packed text (zlib, base64), the most recent pairs remembered up to
    ``budget`` bytes of media: a record decoded and encoded again reuses its packed text.
    Thread-safe (the job worker, the HTTP handlers and the lease renewer all read records)."""

    def __init__(self, budget: int = 256 << 20) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._texts: OrderedDict[bytes, str] = OrderedDict()  # media -> packed
        self._media: dict[str, bytes] = {}  # packed -> media (the same pairs)
        self._bytes = 0

    def pack(self, data: bytes) -> str:
        with self._lock:
            text = self._texts.get(data)
        if text is None:
            text = base64.b64encode(zlib.compress(data, 1)).decode("ascii")
            self._remember(data, text)
        return text

    def unpack(self, text: str) -> bytes:
        with self._lock:
            data = self._media.get(text)
        if data is None:
            data = zlib.decompress(base64.b64decode(text))
            self._remember(data, text)
        return data

    def _remember(self, data: bytes, text: str) -> None:
        if len(data) < 64 << 10:  # small media pack in microseconds: not worth the memory
            return
        with self._lock:
            if data in self._texts:
                return
            self._texts[data], self._media[text] = text, data
            self._bytes += len(data)
            while self._bytes > self.budget and self._texts:
                old, old_text = self._texts.popitem(last=False)
                self._media.pop(old_text, None)
                self._bytes -= len(old)


_packing = _Packing()


def _packed(data: bytes) -> str:
    return _packing.pack(data)


def _unpacked(text: str) -> bytes:
    return _packing.unpack(text)


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
        ConditionImage(i["width"], i["height"], _unpacked(i["rgb"])) for i in data["images"])
    values["loras"] = tuple(LoraRef(**lora) for lora in data["loras"])
    values["references"] = tuple(_decode_reference(r) for r in data.get("references", ()))
    cache = data["step_cache"]
    values["step_cache"] = StepCacheSpec(**cache) if cache is not None else None
    return SamplingParams(**values)
