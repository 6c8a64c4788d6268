"""The whole pipeline under one plan: where the DiT, text encoders and VAE live, and the hooks
that keep them there (issue 34's first part; docs/offload.md, "Whole pipeline").

Called once by the ModelRunner after the pipeline (and DLO, if on) is built. It

- places the text encoders (the pipelines leave them where the loader put them): resident,
  or under ``--offload dlo`` unless ``--dlo-components dit`` offloaded, each
  streamed layer by layer through DLO slots (``encoder_streaming.StreamedEncoders``), or
  parked in host memory (``component_placement.ParkedModules``) when DLO finds no layers
  in it; under an HBM budget, as the budget's plan says (resident, streamed or parked);
- puts the prompt-embedding cache in front of the pipeline's encoder (``prompt_cache``); an
  offloaded encoder moves bytes only on a cache miss;
- encodes the prompts of a step's admitted requests in one encoder pass
  (``batched_encode``);
- decodes a step's finished requests batched by shape, whole or tiled by the budget
  (``decode_batches``; ``--vae-tiling``);
- logs one table: each component, its bytes, where it lives, the activations of each phase
  and the predicted HBM peak against the budget (``budget_plan``, when
  ``--dlo-hbm-budget-gib`` is set: the plan it chose).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from ditserve.engine.allocator import cap_reserved, lift_cap
from ditserve.engine.config import PipelineConfig, ResolvedOffload
from ditserve.engine.pipelines.capabilities import (
    PromptEncoder,
    encoder_reads_images,
    prompt_reads_images,
)
from ditserve.engine.pipelines.vae_decode import (
    IMAGE_TILING_PIXELS,
    VIDEO_TILING_PIXELS,
    VaeTiling,
    tiling_wanted,
)
from ditserve.engine.placement.batched_encode import BatchedEncode
from ditserve.engine.placement.budget_plan import (
    PARKED,
    RESIDENT,
    STREAMED,
    BudgetInputs,
    BudgetPlan,
    describe,
)
from ditserve.engine.placement.component_placement import ParkedModules, module_bytes
from ditserve.engine.placement.decode_batches import DecodeBatches, DecodeRule
from ditserve.engine.placement.encoder_streaming import (
    StreamedEncoders,
    host_side_bytes,
    streamable,
)
from ditserve.engine.placement.prompt_cache import ENCODER_ATTRS, PromptCache, install_prompt_cache
from ditserve.engine.weights.host_check import require_room

log = logging.getLogger(__name__)
GIB = 1 << 30


@dataclass(frozen=True)
class ComponentPlan:
    """One row of the plan. device_bytes: weight bytes it holds on the device all the time;
    transient_bytes: more it holds only during its own pass (a parked encoder's encode, a
    streamed encoder's slots)."""

    name: str
    bytes: int
    lives: str
    device_bytes: int
    transient_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB // 4 else f"{n / (1 << 20):.1f} MiB"


def cap_allocator(device: torch.device, budget: BudgetPlan | None) -> int | None:
    """Hold the process to a numeric ``--dlo-hbm-budget-gib``: torch's caching allocator
    capped at the budget (``engine.allocator.cap_reserved``), so what the process reserves
    never exceeds it. ``auto`` already is the device's free HBM: no cap. Called once the
    DiT and the resident encoders are placed: the end of ``WholePipeline``'s construction,
    whose ``close`` lifts it. Returns the CUDA index capped, or None."""
    if budget is None or budget.auto or device.type != "cuda":
        return None
    index = cap_reserved(device, budget.budget)
    log.info("HBM budget enforced: the caching allocator is capped at %.2f GiB",
             budget.budget / GIB)
    return index


class WholePipeline:
    """The hooks and the plan of one ModelRunner's pipeline (see module docstring)."""

    def __init__(self, pipeline: Any, *, pipeline_config: PipelineConfig,
                 offload: ResolvedOffload, device: torch.device,
                 offload_report: dict[str, Any] | None, inputs: BudgetInputs | None = None,
                 budget: BudgetPlan | None = None, encode_prompts: int | None = None) -> None:
        """pipeline_config: the prompt cache's bounds and the VAE's tiling; offload: the
        resolved offload (whether DLO governs the encoders, how they stream);
        inputs: the planner's inputs (sizes, activation estimates), None if unknown;
        budget: the plan ``--dlo-hbm-budget-gib`` chose (None: no budget);
        encode_prompts: the most prompts an encoder pass fills up to with prompts encoded
        ahead (``batched_encode``; None: unbounded)."""
        self.pipeline = pipeline
        encoders = {name: m for name in ENCODER_ATTRS
                    if isinstance(m := getattr(pipeline, name, None), torch.nn.Module)}
        self.modes = self._encoder_modes(encoders, offload, budget)
        # Pipelines leave their text encoders where the loader put them (host tensors over
        # the checkpoint): the resident ones go to the device here, the others are streamed
        # or parked from there, so the device never holds an offloaded encoder whole.
        for name, module in encoders.items():
            if self.modes[name] == RESIDENT:
                module.to(device)
        self.parked: ParkedModules | None = None
        parked = {name: m for name, m in encoders.items() if self.modes[name] == PARKED}
        text_only = not encoder_reads_images(pipeline)  # vision sides stay on the host
        _require_pin_room(encoders, self.modes, vision=text_only)
        if parked:
            self.parked = ParkedModules(parked, device=device)
        self.streamed = StreamedEncoders(
            {name: m for name, m in encoders.items() if self.modes[name] == STREAMED},
            device=device, offload=offload, vision=text_only)
        self.cache = PromptCache(max_entries=pipeline_config.prompt_cache_size,
                                 max_bytes=int(pipeline_config.prompt_cache_gib * GIB))
        self.plan: list[ComponentPlan] = [self._dit_row(pipeline, offload_report)]
        self.plan += [self._encoder_row(name, m) for name, m in encoders.items()]
        staged: dict[Hashable, Any] = {}
        identity = None
        if isinstance(pipeline, PromptEncoder):
            identity = install_prompt_cache(pipeline, self.cache, staged=staged,
                                            encoders_on_device=self._encoders_context)
        elif encoders:  # encoders without the per-prompt hook: no cache, encoders as placed
            log.warning("%s has no _encode_prompt; the prompt cache is off",
                        type(pipeline).__name__)
        # (No text encoder at all - Cosmos3's DiT reads token ids itself - has nothing to cache.)
        self.encode = BatchedEncode(pipeline, self.cache, identity=identity, staged=staged,
                                    encoders_on_device=self._encoders_context,
                                    max_prompts=encode_prompts)
        self.encode.enabled = self.encode.enabled and identity is not None
        self._prompt_reads_images = prompt_reads_images(pipeline)
        self.inputs, self.budget = inputs, budget
        self.tiling: VaeTiling | None = None
        self.decoder: DecodeBatches | None = None
        vae = getattr(pipeline, "vae", None)
        if isinstance(vae, torch.nn.Module):
            self._install_decode(vae, pipeline_config.vae_tiling, offload=offload.enabled)
            self.plan.append(self._vae_row(vae, pipeline_config.vae_tiling))
        # Last: the DiT and every encoder are placed (see cap_allocator).
        self.capped_device = cap_allocator(device, budget)

    @staticmethod
    def _encoder_modes(encoders: dict[str, torch.nn.Module], offload: ResolvedOffload,
                       budget: BudgetPlan | None) -> dict[str, str]:
        """Each encoder resident, streamed or parked: the budget's choice. Without one, under
        DLO (unless ``--dlo-components dit``) every encoder DLO finds layers in streams and
        the others park: streaming bounds what an encode brings to the device by two
        layers, whatever the (estimated) phases are - parked, Wan's UMT5-XXL put its whole
        10.6 GiB on the device for each encode and set the request's peak on an H200
        (docs/benchmarks.md, "Whole pipeline at full size"); else resident."""
        if budget is not None:
            return {name: budget.encoders.get(name, RESIDENT) for name in encoders}
        if not offload.governs_encoders:
            return {name: RESIDENT for name in encoders}
        return {name: STREAMED if streamable(m) else PARKED for name, m in encoders.items()}

    def close(self) -> None:
        """Streamed encoders back to ordinary modules; the allocator's cap lifted, so the
        process's next runner starts uncapped."""
        self.streamed.close()
        if self.capped_device is not None:
            lift_cap(self.capped_device)
            self.capped_device = None

    def _encoders_context(self) -> AbstractContextManager[Any]:
        return self.parked.on_device() if self.parked is not None else nullcontext()

    def _install_decode(self, vae: torch.nn.Module, mode: str, *, offload: bool) -> None:
        # A VAE that tiles by default keeps its own tiles: its model's frames are the
        # blended-tile ones (MiniMax-H3's), so switching them would change every output.
        own = bool(getattr(vae, "use_tiling", False))
        if not own and mode != "off" and (mode == "on" or offload or self.budget is not None):
            try:
                self.tiling = VaeTiling(vae)
            except TypeError as e:
                log.warning("--vae-tiling %s: %s; decoding whole", mode, e)
        room = None if self.budget is None else self.budget.decode_room
        activations = 0 if self.inputs is None else self.inputs.denoise_activations
        rule = DecodeRule(mode=mode, offload=offload, video=self.pipeline.frame_step is not None,
                          room=room, batch_room=activations)
        self.decoder = DecodeBatches(self.pipeline, self.tiling, rule, self.pipeline.post_decode)
        # Previews and any single decode take the same rule.
        self.pipeline.post_decode = self.decoder.one

    @contextmanager
    def encoding(self, states: Sequence[Any], ahead: Sequence[Any] = ()) -> Iterator[None]:
        """Around a step's ``prepare_encode`` calls: their prompts in one encoder pass, which
        also encodes the prompts of ``ahead`` (the requests next in line, ``StepPlan.upcoming``:
        anything with ``params``) into the prompt cache. A pipeline whose prompts are read with their images
        (``prompt_reads_images``: the prompt cache and the batched pass cannot stage them)
        encodes inside ``prepare_encode``; parked encoders visit the device once for the
        step's calls."""
        reads_images = bool(states) and self._prompt_reads_images
        with self.encode.step(states, ahead), (self._encoders_context() if reads_images
                                               else nullcontext()):
            yield

    def decode(self, states: Sequence[Any]) -> dict[str, str]:
        """Decode a step's finished requests; the failed ones' ids, and why."""
        if self.decoder is None:
            raise RuntimeError("the pipeline has no VAE to decode with")
        return self.decoder.run(states)

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
        if self.parked is not None and name in self.parked.names:
            return ComponentPlan(name, size, f"parked in {self.parked.where()}, on the device "
                                 "only to encode a prompt-cache miss", 0, size)
        if name in self.streamed:
            streamed = self.streamed[name]
            return ComponentPlan(name, size, streamed.lives(),
                                 streamed.device_bytes - streamed.slot_bytes, streamed.slot_bytes)
        return ComponentPlan(name, size, "resident", size)

    def _vae_row(self, vae: torch.nn.Module, mode: str) -> ComponentPlan:
        size = module_bytes(vae)
        batched = "" if self.decoder is None or not self.decoder.batchable else \
            ", same-shape decodes batched"
        if self.tiling is None:
            decode = "whole decode"
        elif mode == "on":
            decode = f"tiled decode ({self.tiling.tile_pixels}px tiles, sliced)"
        elif self.budget is not None:
            decode = (f"tiled decode when a whole one exceeds the budget's "
                      f"{_size(self.budget.decode_room)} decode room "
                      f"({self.tiling.tile_pixels}px tiles)")
        else:
            rule = (f"frames > {VIDEO_TILING_PIXELS} px" if self.pipeline.frame_step is not None
                    else f"images >= {IMAGE_TILING_PIXELS} px")
            decode = f"tiled decode for {rule} ({self.tiling.tile_pixels}px tiles)"
        return ComponentPlan("vae", size, f"resident, {decode}{batched}", size)

    def memory_plan(self) -> BudgetPlan | None:
        """The budget's plan, or the peak of today's placement (None: no estimates)."""
        if self.budget is not None or self.inputs is None:
            return self.budget
        dit = self.plan[0].device_bytes
        frames, height, width = self.inputs.decode_shape
        rule = self.decoder.rule if self.decoder is not None else None
        tiled = self.tiling is not None and rule is not None and tiling_wanted(
            rule.mode, offload=rule.offload, height=height, width=width, video=frames > 1)
        return describe(self.inputs, dit_bytes=dit, encoders=self.modes, tiled=tiled)

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
        lines.append(f"predicted HBM peak for weights: {_size(self.predicted_weight_peak)}")
        lines += _memory_lines(self.memory_plan())
        cache = self.cache
        lines.append("prompt cache: " + (f"{cache.max_entries} entries, "
                                         f"{_size(cache.max_bytes)}" if cache.enabled else "off"))
        return "\n".join(lines)

    def report(self) -> dict[str, Any]:
        """The plan, the memory plan, the prompt cache's and the batched passes' counters
        (for /ready and /metrics)."""
        memory = self.memory_plan()
        return {"plan": [r.to_json() for r in self.plan],
                "predicted_weight_peak_bytes": self.predicted_weight_peak,
                "memory": None if memory is None else memory.to_json(),
                "prompt_cache": self.cache.stats().to_json(),
                "encode": {"passes": self.encode.passes, "prompts": self.encode.prompts,
                           "ahead": self.encode.ahead},
                "decode": {"calls": 0 if self.decoder is None else self.decoder.calls,
                           "requests": 0 if self.decoder is None else self.decoder.decoded}}


def _require_pin_room(encoders: dict[str, torch.nn.Module], modes: dict[str, str], *,
                      vision: bool) -> None:
    """Refuse to start, rather than be OOM-killed, when the offloaded encoders' pinned copies
    (a parked encoder whole, a streamed one's layers) do not fit the host now - the load's
    host plan (``weights.host_check``) checked the same before the DiT was read."""
    pinned = {name: module_bytes(m) - (host_side_bytes(m, vision=vision)
                                       if modes[name] == STREAMED else 0)
              for name, m in encoders.items() if modes[name] in (PARKED, STREAMED)}
    if pinned:
        require_room(sum(pinned.values()),
                     what=f"pinned host copies of {', '.join(pinned)} (offloaded encoders)",
                     remedies=("--dlo-components dit (text encoders resident in HBM)",
                               "their files on a local disk instead of tmpfs (their page "
                               "cache is reclaimable)"))


def _memory_lines(memory: BudgetPlan | None) -> list[str]:
    """The plan table's activation and budget lines."""
    if memory is None:
        return ["activations: not estimated (the DiT has no block lists to plan with)"]
    phases = ", ".join(f"{name} {_size(size)}" for name, size in memory.phases.items())
    lines = [f"activations (estimated, per phase; the largest counts): {phases}",
             f"predicted HBM peak: {_size(memory.predicted_peak)} "
             f"+ {_size(memory.slack)} allocator slack"]
    if memory.budget:
        source = "auto: the device's free HBM" if memory.auto else "--dlo-hbm-budget-gib"
        lines.append(f"HBM budget: {_size(memory.budget)} ({source}); the smallest this "
                     f"pipeline can run in: {_size(memory.minimum)}; "
                     f"{len(memory.resident_blocks)} DiT blocks resident, encoders "
                     f"{memory.encoder_summary()}, decode "
                     f"{'tiled' if memory.decode_tiled else 'whole'} at the planned size")
    return lines
