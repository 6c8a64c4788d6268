"""The one HBM budget of a whole pipeline: what is resident, streamed, parked and tiled.

Pure (no torch): ``plan_budget`` takes the components' byte sizes, the DiT's block sizes and
the activation estimates (``engine.placement.memory_estimates`` measures both off the loaded
pipeline) and a budget, and returns a ``BudgetPlan`` - or raises ``BudgetError`` naming the
smallest budget it could meet. Called by ``engine.runner.assembly`` before DLO is enabled
(the plan's DiT share becomes the offload's own block budget); tested alone on CPU.

The model of the device's memory (docs/offload.md, "Whole pipeline"): weights that stay on
the device (the DiT's resident modules and blocks, its slots, resident encoders and a
streamed encoder's non-layer modules, the VAE) and the prompt cache's bound are held all the
time; on top comes the largest of three phases of a step, which run one after another on one
stream:

- encode: parked encoders visit the device (their bytes), streamed encoders take their slots
  back (``streamed_slots``: given back between passes) plus one batched encoder pass;
- denoise: one step's activations at the scheduler's work budget (``max_batch_tokens``);
- decode: one VAE decode, tiled when a whole decode would not fit.

The predicted peak is that sum; the allocator's slack (fragmentation, cuBLAS workspaces,
rounding of its blocks) comes on top of it and must fit in the budget too.

What the budget buys, cheapest first: the minimum (every block streamed, each encoder
streamed or parked - whichever combination peaks lower - and the decode tiled) must fit or the engine refuses to start; then DiT blocks stay resident while
they fit (each saves a copy per step); then the encoders stay resident (no upload per
cache-miss); whatever is left is the decode's room, which the runner spends per request
shape: whole decodes and several requests per VAE call where they fit.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ditserve.engine.errors import ConfigError
from ditserve.engine.offload.plan import budget_residency

GIB = 1 << 30
RESIDENT, STREAMED, PARKED = "resident", "streamed", "parked"
MIB = 1 << 20
# The allocator's slack: blocks are rounded (2 MiB segments, 512-byte blocks), freed memory
# is split between sizes, and cuBLAS/cuDNN take workspaces through it. 5% of the peak, and
# at least 512 MiB: under a budget's cap the caching allocator reserved 0.25 GiB above the
# allocated peak (Flux, 4 GiB), 0.39 (Qwen-Image, 5 GiB) and 1.35 (Wan, 10 GiB, covered by
# its activation estimate's margin), and a 4 GiB Flux step of two requests ran out with
# 120-360 MiB reserved but unallocated and its allocated HBM already above the plan's peak
# (docs/benchmarks.md, "Issue 45 item 12"). The 256 MiB this once was let that plan through.
SLACK_FRACTION = 0.05
SLACK_MIN_BYTES = 512 * MIB


class BudgetError(ConfigError):
    """The HBM budget cannot hold the pipeline even with everything streamed, parked and
    tiled; ``minimum_bytes`` is the smallest budget that can."""

    def __init__(self, message: str, minimum_bytes: int) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes


@dataclass(frozen=True)
class BudgetInputs:
    """What the planner knows of one pipeline (bytes throughout).

    dit_fixed: the DiT's modules outside its block lists (always resident).
    dit_blocks: each streamable block's bytes as the offload lays it out, in call order.
    slots: device slots streamed blocks go through.
    slot_extra: bytes each slot holds beyond the largest streamed block's layout (the decoded
        region of ``--dlo-dequant slot``: the largest block's GGUF weights in bf16).
    encoders: (name, bytes) of each text encoder.
    parkable: encoders may leave the device - parked in host memory between encodes, or
        streamed layer by layer (``offload.components=all``).
    streamable: (name, bytes held on the device when streamed: its modules outside its layer
        lists and two slots of its largest layer) of each encoder DLO can stream.
    streamed_slots: (name, bytes of those slots) of each streamable encoder whose slots are
        given back between its passes (``enable_offload(release_slots=True)``): counted in
        the encode phase only, not held through the denoise and decode.
    encode_activations: one batched encoder pass over a step's prompts.
    vae: the VAE's weights.
    decode_whole / decode_tiled: one decode's activation peak at the largest shape the plan
        covers, whole or tiled (None: the VAE cannot tile).
    denoise_activations: one step's activations at the scheduler's work budget.
    prompt_cache: the most bytes the prompt cache may hold on the device.
    vae_tiling: the operator's --vae-tiling (auto: chosen by the budget; on; off).
    decode_shape: the (frames, height, width) the decode estimates are for.
    """

    dit_fixed: int
    dit_blocks: tuple[int, ...]
    slots: int
    encoders: tuple[tuple[str, int], ...]
    parkable: bool
    encode_activations: int
    vae: int
    decode_whole: int
    decode_tiled: int | None
    denoise_activations: int
    prompt_cache: int
    vae_tiling: str = "auto"
    streamable: tuple[tuple[str, int], ...] = ()
    decode_shape: tuple[int, int, int] = (1, 1024, 1024)  # (frames, height, width) planned
    slot_extra: int = 0
    streamed_slots: tuple[tuple[str, int], ...] = ()

    @property
    def encoder_bytes(self) -> int:
        return sum(size for _, size in self.encoders)


@dataclass(frozen=True)
class FittedSettings:
    """The scheduler's and prompt cache's settings a budget was planned for, when the
    planner lowered them (``changes``: "--flag old -> new" for the log)."""

    max_num_seqs: int
    max_batch_tokens: int | None
    prompt_cache_gib: float
    changes: tuple[str, ...]


@dataclass(frozen=True)
class BudgetPlan:
    """Where everything lives under the budget, and the peak it predicts (bytes)."""

    budget: int
    resident_blocks: tuple[int, ...]
    dit_budget: int  # what the DiT's own residency may use (its fixed part, slots, blocks)
    encoders: dict[str, str]  # each text encoder: "resident", "streamed" or "parked"
    decode_tiled: bool  # the largest planned decode is tiled
    decode_room: int  # activation bytes a decode call may use (whole, tiled, batched)
    phases: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    minimum: int = 0
    auto: bool = False
    # Serving settings the plan lowered so the budget holds (``fit_settings``): what the
    # runner and the scheduler then use, and one line each saying so.
    settings: FittedSettings | None = None

    @property
    def encoders_resident(self) -> bool:
        return all(mode == RESIDENT for mode in self.encoders.values())

    def encoder_summary(self) -> str:
        """"resident", "parked" or "streamed" when all agree, else each encoder's mode."""
        modes = set(self.encoders.values())
        if len(modes) <= 1:
            return next(iter(modes), RESIDENT)
        return ", ".join(f"{name} {mode}" for name, mode in self.encoders.items())

    @property
    def predicted_peak(self) -> int:
        return sum(self.held.values()) + max(self.phases.values(), default=0)

    @property
    def slack(self) -> int:
        return slack_bytes(self.predicted_peak)

    def to_json(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget, "auto": self.auto, "minimum_bytes": self.minimum,
                "predicted_peak_bytes": self.predicted_peak, "slack_bytes": self.slack,
                "resident_blocks": len(self.resident_blocks),
                "encoders": self.encoder_summary(), "encoder_modes": dict(self.encoders),
                "decode": "tiled" if self.decode_tiled else "whole",
                "decode_room_bytes": self.decode_room,
                "lowered": list(self.settings.changes) if self.settings else [],
                "held_bytes": dict(self.held), "phase_bytes": dict(self.phases)}


def slack_bytes(peak: int) -> int:
    """The allocator's slack above a predicted peak."""
    return max(SLACK_MIN_BYTES, math.ceil(SLACK_FRACTION * peak))


def usable_peak(budget: int) -> int:
    """The largest predicted peak whose slack still fits in ``budget``."""
    return max(0, min(budget - SLACK_MIN_BYTES, math.floor(budget / (1 + SLACK_FRACTION))))


def _decode_need(inputs: BudgetInputs, tiled: bool) -> int:
    if tiled and inputs.decode_tiled is not None:
        return inputs.decode_tiled
    return inputs.decode_whole


def _plan(inputs: BudgetInputs, *, blocks: Sequence[int], encoders: dict[str, str],
          tiled: bool, budget: int, auto: bool) -> BudgetPlan:
    """The plan with these choices (no check that it fits)."""
    keep = set(blocks)
    streamed = [size for i, size in enumerate(inputs.dit_blocks) if i not in keep]
    slots = inputs.slots * (max(streamed) + inputs.slot_extra) if streamed else 0
    held = {"dit": inputs.dit_fixed + sum(inputs.dit_blocks[i] for i in blocks),
            "dit slots": slots, "vae": inputs.vae, "prompt cache": inputs.prompt_cache}
    streamed_held, released = dict(inputs.streamable), dict(inputs.streamed_slots)
    streaming = [name for name, _ in inputs.encoders if encoders[name] == STREAMED]
    held["encoders"] = sum(size if encoders[name] == RESIDENT else
                           streamed_held[name] - released.get(name, 0)
                           if encoders[name] == STREAMED else 0
                           for name, size in inputs.encoders)
    parked = sum(size for name, size in inputs.encoders if encoders[name] == PARKED)
    # Released slots come back for the encode only; the encoders encode one after another,
    # each giving its slots back as its pass ends, but counting them together errs large.
    visiting = parked + sum(released.get(name, 0) for name in streaming)
    phases = {"encode": inputs.encode_activations + visiting,
              "denoise": inputs.denoise_activations,
              "decode": _decode_need(inputs, tiled)}
    return BudgetPlan(budget=budget, resident_blocks=tuple(sorted(blocks)),
                      dit_budget=held["dit"] + slots, encoders=dict(encoders),
                      decode_tiled=tiled and inputs.decode_tiled is not None, decode_room=0,
                      phases=phases, held=held, auto=auto)


def least_encoders(inputs: BudgetInputs, tiled: bool) -> dict[str, str]:
    """Each encoder streamed or parked, whichever combination gives the lowest peak
    (streaming holds its non-layer modules all the time and its slots at least while it
    encodes; parking holds the whole encoder while it encodes)."""
    if not inputs.parkable:
        return {name: RESIDENT for name, _ in inputs.encoders}
    options = [[PARKED, STREAMED] if name in dict(inputs.streamable) else [PARKED]
               for name, _ in inputs.encoders]
    names = [name for name, _ in inputs.encoders]
    best: tuple[int, dict[str, str]] | None = None
    for combo in itertools.product(*options):
        modes = dict(zip(names, combo, strict=True))
        peak = _plan(inputs, blocks=(), encoders=modes, tiled=tiled, budget=0,
                     auto=False).predicted_peak
        if best is None or peak < best[0]:
            best = (peak, modes)
    return best[1] if best is not None else {}


def describe(inputs: BudgetInputs, *, dit_bytes: int, encoders: dict[str, str],
             tiled: bool) -> BudgetPlan:
    """The peak of a placement chosen without a budget (resident serving, or DLO with a
    fixed residency): ``dit_bytes`` on the device for the DiT, slots included."""
    plan = _plan(inputs, blocks=(), encoders=encoders, tiled=tiled, budget=0, auto=False)
    held = {**plan.held, "dit": dit_bytes, "dit slots": 0}
    return replace(plan, held=held, dit_budget=dit_bytes)


def _fits(plan: BudgetPlan) -> bool:
    return plan.predicted_peak + plan.slack <= plan.budget


def plan_budget(inputs: BudgetInputs, budget: int, *, auto: bool = False) -> BudgetPlan:
    """The placement of every component under ``budget`` bytes (see the module docstring);
    raises ``BudgetError`` with the smallest budget that fits when even the minimum does not."""
    tile_allowed = inputs.vae_tiling != "off" and inputs.decode_tiled is not None
    must_tile = inputs.vae_tiling == "on" and inputs.decode_tiled is not None
    least_modes = least_encoders(inputs, tile_allowed)
    least = _plan(inputs, blocks=(), encoders=least_modes, tiled=tile_allowed,
                  budget=budget, auto=auto)
    minimum = least.predicted_peak + least.slack
    if minimum > budget:
        raise BudgetError(_refusal(least, minimum, auto=auto), minimum)
    # The DiT's residency: the offload's own rule (blocks spread along the order) within what
    # the rest leaves once it and the largest phase are paid at their minimum.
    others = sum(least.held.values()) - least.held["dit"] - least.held["dit slots"]
    dit_budget = usable_peak(budget) - others - max(least.phases.values())
    # The minimum fits, so the DiT's streamed minimum does (the slack's rounding aside).
    dit_budget = max(dit_budget, least.held["dit"] + least.held["dit slots"])
    residency = budget_residency(list(inputs.dit_blocks), budget_bytes=dit_budget,
                                 fixed_bytes=inputs.dit_fixed, activation_reserve_bytes=0,
                                 slots=inputs.slots, slot_extra_bytes=inputs.slot_extra)
    blocks = residency.resident
    plan = _plan(inputs, blocks=blocks, encoders=least_modes, tiled=tile_allowed,
                 budget=budget, auto=auto)
    resident = _plan(inputs, blocks=blocks, encoders={name: RESIDENT for name in least_modes},
                     tiled=tile_allowed, budget=budget, auto=auto)
    plan = resident if _fits(resident) else plan
    if not must_tile and tile_allowed:
        whole = _plan(inputs, blocks=blocks, encoders=plan.encoders, tiled=False,
                      budget=budget, auto=auto)
        plan = whole if _fits(whole) else plan
    room = usable_peak(budget) - sum(plan.held.values())
    return replace(plan, decode_room=room, minimum=minimum, dit_budget=dit_budget)


def _gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB" if size >= 10 * MIB else f"{size / MIB:.1f} MiB"


def _refusal(least: BudgetPlan, minimum: int, *, auto: bool) -> str:
    what = "the free HBM of the device" if auto else "--dlo-hbm-budget-gib"
    held = ", ".join(f"{name} {_gib(size)}" for name, size in least.held.items() if size)
    phase, peak = max(least.phases.items(), key=lambda item: item[1])
    least_gib = math.ceil(minimum / GIB * 100) / 100
    return (f"{what} ({least.budget / GIB:.2f} GiB) cannot hold the pipeline; the smallest "
            f"budget it can run in is {least_gib:.2f} GiB (every DiT block streamed, "
            f"encoders {least.encoder_summary()}, decode tiled where the VAE can): held "
            f"{held}; plus the {phase} phase's {_gib(peak)}; plus {_gib(least.slack)} "
            f"allocator slack. Set --dlo-hbm-budget-gib {least_gib:.2f} or more, lower "
            "--max-batch-tokens or --prompt-cache-gib, or free device memory")


def decode_batch(room: int, *, rows: int, whole_per_row: int, tiled_per_row: int | None,
                 tiling: str, limit: int) -> tuple[int, bool]:
    """How many same-shape requests (``rows`` rows each) one VAE call decodes within
    ``room``, and whether tiled: whole (all rows at once) when it fits, else tiled and
    sliced (one row at a time, so its peak does not grow with the batch). At least one."""
    if tiling != "on":
        whole = room // max(1, rows * whole_per_row)
        if whole >= 1 or tiled_per_row is None or tiling == "off":
            return max(1, min(limit, whole)), False
    return max(1, limit), True
