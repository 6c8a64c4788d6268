"""The whole pipeline under one plan: where the DiT, text encoders and VAE live, and the hooks
that keep them there (issue 34's first part; docs/offload.md, "Whole pipeline").

Called once by the ModelRunner after the pipeline (and DLO, if on) is built. It

- parks the text encoders in host memory under ``--offload dlo`` unless
  ``--dlo-components dit`` (``component_placement.ParkedModules``);
- puts the prompt-embedding cache in front of the pipeline's encoder (``prompt_cache``); a
  parked encoder visits the device only on a cache miss;
- wraps ``post_decode`` so each decode tiles when ``--vae-tiling`` says so
  (``pipelines.vae_decode``);
- logs one table: each component, its bytes, where it lives, and the predicted HBM peak of
  the weights.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from ditserve.engine.config import EngineConfig
from ditserve.engine.pipelines.vae_decode import (
    IMAGE_TILING_PIXELS,
    VIDEO_TILING_PIXELS,
    VaeTiling,
    tiled_post_decode,
)
from ditserve.engine.runner.component_placement import ParkedModules, module_bytes
from ditserve.engine.runner.prompt_cache import ENCODER_ATTRS, PromptCache, install_prompt_cache

log = logging.getLogger(__name__)
GIB = 1 << 30


@dataclass(frozen=True)
class ComponentPlan:
    """One row of the plan. device_bytes: weight bytes it holds on the device all the time;
    transient_bytes: more it holds only during its own pass (a parked encoder's encode)."""

    name: str
    bytes: int
    lives: str
    device_bytes: int
    transient_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 4 else f"{n / (1 << 20):.1f} MiB"


class WholePipeline:
    """The hooks and the plan of one ModelRunner's pipeline (see module docstring)."""

    def __init__(self, pipeline: Any, config: EngineConfig, *, device: torch.device,
                 offload_report: dict[str, Any] | None) -> None:
        self.pipeline = pipeline
        offload = config.offload.enabled
        encoders = {name: m for name in ENCODER_ATTRS
                    if isinstance(m := getattr(pipeline, name, None), torch.nn.Module)}
        self.parked: ParkedModules | None = None
        if offload and config.offload.components == "all" and encoders:
            self.parked = ParkedModules(encoders, device=device)
        pipe = config.pipeline
        self.cache = PromptCache(max_entries=pipe.prompt_cache_size,
                                 max_bytes=int(pipe.prompt_cache_gib * GIB))
        self.plan: list[ComponentPlan] = [self._dit_row(pipeline, offload_report)]
        self.plan += [self._encoder_row(name, m) for name, m in encoders.items()]
        if hasattr(pipeline, "_encode_prompt"):
            install_prompt_cache(pipeline, self.cache, encoders_on_device=self._encoders_context)
        else:  # a pipeline without the per-prompt encoder hook: no cache, encoders as placed
            log.warning("%s has no _encode_prompt; the prompt cache is off",
                        type(pipeline).__name__)
        self.tiling: VaeTiling | None = None
        vae = getattr(pipeline, "vae", None)
        if isinstance(vae, torch.nn.Module):
            self._install_tiling(vae, pipe.vae_tiling, offload=offload)
            self.plan.append(self._vae_row(vae, pipe.vae_tiling, offload=offload))

    def _encoders_context(self) -> AbstractContextManager[Any]:
        return self.parked.on_device() if self.parked is not None else nullcontext()

    def _install_tiling(self, vae: torch.nn.Module, mode: str, *, offload: bool) -> None:
        if mode == "off" or (mode == "auto" and not offload):
            return
        try:
            self.tiling = VaeTiling(vae)
        except TypeError as e:
            log.warning("--vae-tiling %s: %s; decoding whole", mode, e)
            return
        self.pipeline.post_decode = tiled_post_decode(
            self.pipeline.post_decode, self.tiling, mode=mode, offload=offload,
            video=self.pipeline.frame_step is not None)

    @staticmethod
    def _dit_row(pipeline: Any, report: dict[str, Any] | None) -> ComponentPlan:
        if report is None:
            size = module_bytes(pipeline.transformer)
            return ComponentPlan("transformer", size, "resident", size)
        resident = int(report.get("resident_block_bytes", 0)) + int(
            report.get("resident_module_bytes", 0))
        slots = int(report.get("slot_bytes", 0)) * int(report.get("slots", 0))
        total = int(report.get("streamed_bytes", 0)) + resident
        lives = (f"streamed by DLO: {report.get('streamed_blocks')} of {report.get('blocks')} "
                 f"blocks from host, {report.get('slots')} slots")
        return ComponentPlan("transformer", total, lives, resident + slots)

    def _encoder_row(self, name: str, module: torch.nn.Module) -> ComponentPlan:
        size = module_bytes(module)
        if self.parked is not None:
            return ComponentPlan(name, size, f"parked in {self.parked.where()}, on the device "
                                 "only to encode a prompt-cache miss", 0, size)
        return ComponentPlan(name, size, "resident", size)

    def _vae_row(self, vae: torch.nn.Module, mode: str, *, offload: bool) -> ComponentPlan:
        size = module_bytes(vae)
        if self.tiling is None:
            decode = "whole decode"
        elif mode == "on":
            decode = f"tiled decode ({self.tiling.tile_pixels}px tiles, sliced)"
        else:
            rule = (f"frames > {VIDEO_TILING_PIXELS} px" if self.pipeline.frame_step is not None
                    else f"images >= {IMAGE_TILING_PIXELS} px")
            decode = f"tiled decode for {rule} ({self.tiling.tile_pixels}px tiles)"
        return ComponentPlan("vae", size, f"resident, {decode}", size)

    @property
    def predicted_weight_peak(self) -> int:
        """Weights' HBM peak: everything held all the time plus the largest transient pass
        (parked encoders all visit together, during one encode)."""
        return sum(r.device_bytes + r.transient_bytes for r in self.plan)

    def plan_table(self) -> str:
        rows = [("component", "bytes", "on device", "lives")]
        rows += [(r.name, _size(r.bytes),
                  _size(r.device_bytes) + (f" (+{_size(r.transient_bytes)} encoding)"
                                           if r.transient_bytes else ""), r.lives)
                 for r in self.plan]
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True))
                 + "  " + row[3] for row in rows]
        lines.append(f"predicted HBM peak for weights: {_size(self.predicted_weight_peak)} "
                     "(activations, cached prompt embeddings and allocator slack come on top)")
        cache = self.cache
        lines.append("prompt cache: " + (f"{cache.max_entries} entries, "
                                         f"{_size(cache.max_bytes)}" if cache.enabled else "off"))
        return "\n".join(lines)

    def report(self) -> dict[str, Any]:
        """The plan and the prompt cache's counters (for /ready and /metrics)."""
        return {"plan": [r.to_json() for r in self.plan],
                "predicted_weight_peak_bytes": self.predicted_weight_peak,
                "prompt_cache": self.cache.stats().to_json()}
