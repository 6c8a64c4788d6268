"""Cosmos3's DiT in the offload comparison (``offload_families.py --model cosmos3[-super]``):
its forward's inputs as the step pipeline makes them, where its token table lives, and the
issue's Cosmos3 targets.

A step of one request with CFG is one forward over two packed sequences (the prompt's and
the negative prompt's, ``engine.families.cosmos3.packing``), each ~200 prompt tokens before
the video's latent patches (1280x720x189: 48 x 23 x 40). Positions are diffusers' own mRoPE
ids (its pipeline module's helpers); the latents are random bf16 at timestep 500.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from offload_methods import find, target

from ditserve.engine.families.cosmos3.block import chunk_token_math
from ditserve.engine.families.cosmos3.packing import (
    ItemLayout,
    PackedItemsProcessor,
    StepItem,
    items_in_flight,
    joint_inputs,
)
from ditserve.engine.families.cosmos3.pipeline import keep_on_host

GIB = 1024**3
PROMPT_TOKENS = (210, 190)  # a templated prompt and its negative, as tokenized (about)
FPS = 24.0


def prepare(dit: Any) -> None:
    """The engine's attention over packed sequences (one forward per step) and its sliced
    feed-forwards, as served."""
    dit.set_attn_processor(PackedItemsProcessor())
    chunk_token_math(dit)


def host_modules(dit: Any, device: torch.device) -> Sequence[torch.nn.Module]:
    """Under DLO the token table and the LM head move to host memory and stay there, as the
    step pipeline keeps them (built on the device, they are moved off it first)."""
    for name in ("embed_tokens", "lm_head"):
        getattr(dit, name).to("cpu")
    return keep_on_host(dit, device)


def _layout(dit: Any, prompt: int, grid: tuple[int, int, int], device: torch.device,
            ids_device: torch.device) -> ItemLayout:
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (
        get_3d_mrope_ids_text_tokens,
        get_3d_mrope_ids_vae_tokens,
    )

    config = dit.config
    text, offset = get_3d_mrope_ids_text_tokens(prompt, 0, use_float_positions=True)
    vision, _ = get_3d_mrope_ids_vae_tokens(
        *grid, offset + config.unified_3d_mrope_temporal_modality_margin, fps=FPS,
        base_fps=float(config.base_fps), temporal_compression_factor=4)
    t, h, w = grid
    return ItemLayout(
        input_ids=torch.randint(0, int(config.vocab_size), (prompt,), device=ids_device),
        und_positions=text.to(device), gen_positions=vision.float().to(device),
        vision_grid=grid, noisy_frames=torch.arange(t, device=device),
        noisy_vision=torch.arange(t * h * w, device=device), sound_len=0)


def step(dit: Any, dims: Sequence[int], *, requests: int, device: torch.device
         ) -> Callable[[], Any]:
    """One denoise forward of ``requests`` requests with CFG at WIDTHxHEIGHTxFRAMES."""
    width, height, frames = dims
    latent = ((frames - 1) // 4 + 1, height // 16, width // 16)  # Wan 2.2 VAE: 4x, 16x
    p = int(dit.config.latent_patch_size)
    grid = (latent[0], -(-latent[1] // p), -(-latent[2] // p))
    ids_device = dit.embed_tokens.weight.device  # the host, under DLO (as served)
    items = []
    for _ in range(requests):
        vision = torch.randn(1, int(dit.config.latent_channel), *latent, device=device,
                             dtype=torch.bfloat16)
        items += [StepItem(_layout(dit, n, grid, device, ids_device), vision, None, 500.0)
                  for n in PROMPT_TOKENS]
    kwargs = joint_inputs(items, dtype=torch.bfloat16, device=device)

    def forward() -> Any:
        with items_in_flight(items):
            return dit(**kwargs, return_dict=False)

    return forward


def targets(r: dict[str, Any], dlo: dict[str, Any], gbps: float | None) -> list[dict[str, Any]]:
    """The issue's Cosmos3 targets: DLO b1 <= 1.02 x max(resident step, streamed-bytes
    floor); with ``--baseline`` (a Nano run), the DLO peak HBM growth to this DiT, and that
    peak split into the offload's own share and the activations' (``peak_split``)."""
    out = []
    d1, r1 = find(r, "dlo", "b1 cfg"), find(r, "resident", "b1 cfg")
    if d1 and r1 and gbps:
        floor = dlo["streamed_bytes"] / (gbps * 1e9) * 1e3
        out.append(target("DLO b1 <= 1.02 x max(resident, streamed-bytes floor)", d1["ms"],
                          1.02 * max(r1["ms"], floor), "ms"))
    if d1 and r.get("baseline"):
        base = json.loads(Path(r["baseline"]).read_text())
        nano = find(base, "dlo", "b1 cfg")
        if nano:
            out.append(target("DLO peak HBM growth from the baseline run <= 25%",
                              d1["peak_hbm_bytes"] / GIB,
                              1.25 * nano["peak_hbm_bytes"] / GIB, "GiB"))
            nano_dlo = base["methods"]["dlo"]["report"]
            out += peak_split(d1["peak_hbm_bytes"], dlo, nano["peak_hbm_bytes"], nano_dlo)
    return out


def offload_own_bytes(report: dict[str, Any]) -> int:
    """HBM the offload itself holds: its block slots and the resident (non-block) modules."""
    return int(report["slots"] * report["slot_bytes"] + report["resident_module_bytes"])


def peak_split(peak: int, report: dict[str, Any], nano_peak: int, nano_report: dict[str, Any]
               ) -> list[dict[str, Any]]:
    """The growth target's peak split in two, for reading it (no bound: the issue's target is
    the peak): what the offload holds (slots + resident modules, set by the block size) and
    the rest (one layer's activations at the step's token count, the forward's own buffers,
    allocator slack: set by the model's widths, not by the offload)."""
    rows = []
    for name, mine, theirs in (
            ("offload's own HBM (2 slots + resident modules)", offload_own_bytes(report),
             offload_own_bytes(nano_report)),
            ("activations and the rest (peak - offload's own)",
             peak - offload_own_bytes(report), nano_peak - offload_own_bytes(nano_report))):
        growth = f"{100 * (mine / theirs - 1):+.0f}%" if theirs > 0 else "-"  # CPU: no peak
        rows.append(target(f"(split, no bound) {name}: baseline {theirs / GIB:.2f} GiB, "
                           f"{growth}", mine / GIB, None, "GiB"))
    return rows
