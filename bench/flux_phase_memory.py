#!/usr/bin/env python3
"""Each activation term of the HBM planner against what the full-size Flux pipeline's own code
holds, counted on the ``meta`` device (no GPU, no weights: seconds on a laptop).

``--dlo-hbm-budget-gib`` plans a replica as weights held all the time plus the largest of
three phases (docs/offload.md, "One HBM budget"); the phases' activations are estimates
(``engine.placement.memory_estimates``). This program builds FLUX.1-dev's parts at their
released shapes on the meta device - the step pipeline the engine serves, T5-XXL, CLIP-L and
the VAE - and for each phase counts the live tensors op by op (``live_bytes.LiveBytes``) of
the code the engine runs:

- denoise: one DiT forward of ``rows`` 1024x1024 rows (4096 image + 512 text tokens each)
  through one double and one single block at full width - a 57-block forward peaks in a block
  and frees it before the next, so its peak is these two blocks' (their inputs, the
  embeddings and the rotary tables included);
- encode: one batched encoder pass as the pipeline runs it (CLIP-L, then T5-XXL over 512
  tokens) over ``2 x rows`` prompts, the batch the planner counts per step;
- decode: the VAE decode of ``rows`` 1024x1024 latents and the float32 post-processing, whole
  and tiled (the engine's ``VaeTiling``: 512-pixel tiles, one row at a time).

Printed beside each count: the planner's estimate for the same shape and their ratio (the
estimate must not be below the count: the count is what the code allocates, before CUDA's
own additions - the allocator's rounding and slack, cuBLAS workspaces), then the plan
``--dlo-hbm-budget-gib`` makes of the whole pipeline at the given budgets (held terms, phases,
what it lowered).

    python3 bench/flux_phase_memory.py                     # rows 1 2 4; budgets 4 and 5 GiB
    python3 bench/flux_phase_memory.py --rows 2 --budgets 4
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from live_bytes import peak_bytes

from ditserve.engine.config import (
    OffloadConfig,
    PipelineConfig,
    ResolvedOffload,
    SchedulerConfig,
)
from ditserve.engine.makers.builders import build_pipeline, dit_class, dit_config
from ditserve.engine.pipelines.vae_decode import VaeTiling
from ditserve.engine.placement.budget_plan import GIB, BudgetError
from ditserve.engine.placement.memory_estimates import (
    TEMPLATE_TOKENS,
    budget_inputs,
    decode_bytes,
    encode_activation_bytes,
)
from ditserve.engine.runner.assembly import PlanSettings, fit_settings
from ditserve.engine.weights.loader import LoadedComponents

SIDE = 1024  # pixels: the planner's reference request (``Family.reference_work``)
TEXT = 512  # T5 tokens: FLUX.1-dev pads every prompt to 512
META = torch.device("meta")


def meta_pipeline() -> Any:
    """The engine's Flux step pipeline over FLUX.1-dev's parts at released shapes, on meta."""
    from ditserve.engine.families.flux.pipeline import FluxStepPipeline

    parts = build_pipeline("flux", "full", dtype=torch.bfloat16, device=META, seed=0,
                           components="all")
    loaded = LoadedComponents(pipeline_class="FluxPipeline", model_dir=Path("."),
                              modules=dict(parts.components), pipeline=parts)
    return FluxStepPipeline(loaded, device=META, move_transformer=False)


def two_block_dit() -> torch.nn.Module:
    """FLUX.1-dev's DiT at full width with one double and one single block, on meta."""
    config = dict(dit_config("flux", "full"), num_layers=1, num_single_layers=1)
    with META:
        return dit_class("flux")(**config).to(torch.bfloat16).eval()


def dit_step_bytes(dit: torch.nn.Module, rows: int, *, side: int = SIDE,
                   text: int = TEXT) -> int:
    """Live-bytes peak of one DiT forward over ``rows`` rows of a ``side``-pixel square."""
    tokens = (side // 16) ** 2
    config = dit.config

    def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=META)

    guidance = meta(rows, dtype=torch.float32) if config.guidance_embeds else None
    peak, _ = peak_bytes(
        dit, hidden_states=meta(rows, tokens, config.in_channels), timestep=meta(rows),
        guidance=guidance, pooled_projections=meta(rows, config.pooled_projection_dim),
        encoder_hidden_states=meta(rows, text, config.joint_attention_dim),
        txt_ids=meta(text, 3), img_ids=meta(tokens, 3), return_dict=False)
    return peak


def encode_bytes(pipeline: Any, prompts: int) -> int:
    """Live-bytes peak of one batched encoder pass over ``prompts`` prompts, as the
    pipeline's ``_encode_prompts`` runs it: CLIP-L over 77 tokens (its pooled output kept),
    then T5-XXL over 512, both outputs in the compute dtype."""
    clip_ids = torch.zeros(prompts, pipeline.clip_max_length, dtype=torch.long, device=META)
    t5_ids = torch.zeros(prompts, TEXT, dtype=torch.long, device=META)

    def encode() -> tuple[torch.Tensor, torch.Tensor]:
        pooled = pipeline.text_encoder(clip_ids, output_hidden_states=False).pooler_output
        seq = pipeline.text_encoder_2(t5_ids, output_hidden_states=False)[0]
        return seq.to(pipeline.dtype), pooled.to(pipeline.dtype)

    peak, _ = peak_bytes(encode)
    return peak


def decode_peak_bytes(vae: Any, rows: int, *, tiled: bool, side: int = SIDE) -> int:
    """Live-bytes peak of decoding ``rows`` latents of a ``side`` square and the pipeline's
    float32 post-processing (``FluxStepPipeline.post_decode``, up to the host copy)."""
    tiling = VaeTiling(vae)
    tiling.set(tiled)
    latents = torch.empty(rows, vae.config.latent_channels, side // 8, side // 8,
                          dtype=torch.bfloat16, device=META)

    def decode() -> torch.Tensor:
        decoded = vae.decode(latents, return_dict=False)[0]
        return (decoded.float() / 2 + 0.5).clamp(0, 1)

    try:
        peak, _ = peak_bytes(decode)
    finally:
        tiling.set(False)
    return peak


@dataclass(frozen=True)
class Term:
    phase: str
    shape: str
    planned: int
    counted: int

    @property
    def ratio(self) -> float:
        return self.planned / max(1, self.counted)


def terms(pipeline: Any, dit: torch.nn.Module, rows: int) -> list[Term]:
    """The planner's estimate and the count of each phase for ``rows`` 1024x1024 requests."""
    inputs = budget_inputs(pipeline, scheduler=SchedulerConfig(max_num_seqs=rows),
                           pipeline_config=PipelineConfig(), offload=dlo_offload())
    t5 = pipeline.text_encoder_2
    shape = {"frames": 1, "height": SIDE, "width": SIDE}
    return [
        Term("denoise", f"{rows} x (4096 + 512) tokens", inputs.denoise_activations,
             dit_step_bytes(dit, rows)),
        # The planner counts two prompts a request (a negative prompt's row under CFG).
        Term("encode", f"{2 * rows} prompts x 512 tokens",
             encode_activation_bytes(t5, prompts=2 * rows, tokens=TEXT + TEMPLATE_TOKENS),
             encode_bytes(pipeline, 2 * rows)),
        Term("decode whole", f"{rows} x 1024x1024",
             decode_bytes(pipeline.vae, rows=rows, tiled=False, **shape),
             decode_peak_bytes(pipeline.vae, rows, tiled=False)),
        Term("decode tiled", f"{rows} x 1024x1024 (one row at a time)",
             decode_bytes(pipeline.vae, rows=1, tiled=True, **shape),
             decode_peak_bytes(pipeline.vae, rows, tiled=True)),
    ]


def dlo_offload() -> ResolvedOffload:
    """``--offload dlo`` with the text encoders governed too (the default)."""
    return ResolvedOffload(mode="local", components="all", options=OffloadConfig(enabled=True))


def plan_at(pipeline: Any, budget_gib: float, max_num_seqs: int) -> dict[str, Any]:
    """The whole pipeline's plan under ``budget_gib`` from default flags but ``max_num_seqs``
    (what ``--dlo-hbm-budget-gib`` makes at start, lowering settings as it must)."""
    offload = replace(dlo_offload(), budget_gib=budget_gib)
    settings = PlanSettings(scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
                            pipeline=PipelineConfig(), offload=offload)
    try:
        plan = fit_settings(pipeline, settings, int(budget_gib * GIB), auto=False)
    except BudgetError as e:  # below even the smallest placement
        return {"refused": str(e)}
    if plan is None:
        return {"refused": "one request per step with a small prompt cache does not fit"}
    return {"plan": plan}


def _gib(size: int) -> str:
    return f"{size / GIB:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4],
                   help="1024x1024 requests per step (one row each: Flux runs no CFG rows)")
    p.add_argument("--budgets", type=float, nargs="*", default=[4.0, 5.0],
                   help="--dlo-hbm-budget-gib values to plan (GiB)")
    p.add_argument("--max-num-seqs", type=int, default=4)
    args = p.parse_args(argv)
    pipeline = meta_pipeline()
    dit = two_block_dit()
    print("FLUX.1-dev at released shapes on the meta device; GiB; planned = the planner's "
          "estimate, counted = live tensors of the engine's code")
    print("| phase | shape | planned | counted | planned / counted |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        for term in terms(pipeline, dit, rows):
            print(f"| {term.phase} | {term.shape} | {_gib(term.planned)} | "
                  f"{_gib(term.counted)} | {term.ratio:.2f} |")
    for budget in args.budgets:
        result = plan_at(pipeline, budget, args.max_num_seqs)
        if "refused" in result:
            print(f"\n--dlo-hbm-budget-gib {budget:g}: refused: {result['refused']}")
            continue
        plan = result["plan"]
        lowered = "; ".join(plan.settings.changes) if plan.settings else "nothing"
        held = ", ".join(f"{name} {_gib(size)}" for name, size in plan.held.items())
        phases = ", ".join(f"{name} {_gib(size)}" for name, size in plan.phases.items())
        print(f"\n--dlo-hbm-budget-gib {budget:g} (--max-num-seqs {args.max_num_seqs}): "
              f"lowered {lowered}; held {held}; phases {phases}; predicted peak "
              f"{_gib(plan.predicted_peak)} + slack {_gib(plan.slack)}; "
              f"{len(plan.resident_blocks)} DiT blocks resident, encoders "
              f"{plan.encoder_summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
