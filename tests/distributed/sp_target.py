"""Spawn target for the sequence-parallel DiT tests: one gloo rank of an SP group.

Every rank builds the same seeded tiny DiT of each family, runs the plain forward (the SP 1
reference) on a copy, shards the model over the group (``shard_dit``) and runs the same
inputs again: the sharded output must equal the reference on every rank. The cases cover
token counts that divide by the group and ones that need padding (odd latent grids, odd
prompt lengths), several rows, Qwen-Image's mask of right-padded prompts, Wan's cross
attention and Wan 2.2 TI2V's per-token timesteps. Each case's largest difference goes to
``<out>/rank<r>.json``; the parent asserts on them. Any exception fails the spawn.
"""

from __future__ import annotations

import copy
import datetime
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from distributed.rendezvous_support import join_group  # type: ignore[import-not-found]

from ditserve.engine.parallel.sharding import shard_dit
from ditserve.engine.parallel.ulysses import SequenceGroup, ulysses_attention

Inputs = Callable[[], dict[str, Any]]


def _flux_model() -> Any:
    from diffusers import FluxTransformer2DModel

    from ditserve.engine.families.flux import TINY_DIT as TINY_TRANSFORMER

    torch.manual_seed(0)
    return FluxTransformer2DModel(**TINY_TRANSFORMER).eval()


def _family_model(variant: str) -> Any:
    from ditserve.engine.makers.builders import make_dit

    return make_dit(variant, "tiny", dtype=torch.float32, device="cpu", seed=0)


def _flux_inputs(rows: int, h: int, w: int, text: int) -> Inputs:
    def make() -> dict[str, Any]:
        g = torch.Generator().manual_seed(h * 100 + w * 10 + text)
        ids = torch.zeros(h, w, 3)
        ids[..., 1] += torch.arange(h)[:, None]
        ids[..., 2] += torch.arange(w)[None, :]
        return dict(hidden_states=torch.randn(rows, h * w, 16, generator=g),
                    encoder_hidden_states=torch.randn(rows, text, 32, generator=g),
                    pooled_projections=torch.randn(rows, 32, generator=g),
                    timestep=torch.rand(rows, generator=g), guidance=torch.full((rows,), 3.5),
                    img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(text, 3))
    return make


def _qwen_inputs(rows: int, h: int, w: int, text: int, masked: bool) -> Inputs:
    def make() -> dict[str, Any]:
        g = torch.Generator().manual_seed(h * 100 + w * 10 + text)
        mask = None
        if masked:  # right-padded prompts: row i has text - 2*i real tokens
            mask = torch.zeros(rows, text, dtype=torch.bool)
            for row in range(rows):
                mask[row, : text - 2 * row] = True
        return dict(hidden_states=torch.randn(rows, h * w, 64, generator=g),
                    encoder_hidden_states=torch.randn(rows, text, 32, generator=g),
                    encoder_hidden_states_mask=mask, timestep=torch.rand(rows, generator=g),
                    img_shapes=[[(1, h, w)]] * rows)
    return make


def _wan_inputs(rows: int, channels: int, frames: int, h: int, w: int, *,
                per_token: bool = False) -> Inputs:
    def make() -> dict[str, Any]:
        g = torch.Generator().manual_seed(frames * 100 + h * 10 + w)
        timestep = torch.rand(rows, generator=g) * 1000
        if per_token:  # TI2V: (rows, tokens)
            timestep = timestep[:, None].expand(rows, frames * (h // 2) * (w // 2)).contiguous()
        return dict(hidden_states=torch.randn(rows, channels, frames, h, w, generator=g),
                    timestep=timestep,
                    encoder_hidden_states=torch.randn(rows, 12, 32, generator=g))
    return make


# name -> (model builder, inputs): token counts noted as (image tokens, text tokens).
CASES: dict[str, tuple[Callable[[], Any], list[Inputs]]] = {
    "flux": (_flux_model, [
        _flux_inputs(2, 4, 4, 8),    # (16, 8): divides
        _flux_inputs(3, 3, 5, 7),    # (15, 7): both streams padded
    ]),
    "qwen-image": (lambda: _family_model("qwen-image"), [
        _qwen_inputs(2, 4, 4, 8, masked=False),  # (16, 8)
        _qwen_inputs(3, 3, 5, 7, masked=True),   # (15, 7), right-padded prompts
    ]),
    "wan": (lambda: _family_model("wan"), [
        _wan_inputs(2, 16, 2, 4, 4),   # 8 tokens
        _wan_inputs(2, 16, 3, 6, 10),  # 45 tokens: padded
    ]),
    "wan2.2-ti2v": (lambda: _family_model("wan2.2-ti2v"), [
        _wan_inputs(2, 48, 3, 6, 6, per_token=True),  # 27 tokens, per-token timesteps
    ]),
}


def _first_block(model: Any) -> Any:
    blocks = getattr(model, "transformer_blocks", None) or model.blocks
    return blocks[0]


@torch.inference_mode()
def _check(build: Callable[[], Any], inputs: list[Inputs], sp: SequenceGroup
           ) -> list[dict[str, Any]]:
    """Per input: the largest difference to the plain forward, and the image tokens the first
    block saw unsharded and sharded (evidence the forward really ran on a shard)."""
    model = build()
    plain = copy.deepcopy(model)
    sharded = model
    shard_dit(sharded, sp)
    seen: dict[str, int] = {}

    def record(name: str) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            seen[name] = int(hidden.shape[1])
        return hook

    _first_block(plain).register_forward_pre_hook(record("plain"), with_kwargs=True)
    # Registered after sharding's own pre-hook, so it sees the sliced tokens.
    _first_block(sharded).register_forward_pre_hook(record("sharded"), with_kwargs=True)
    results = []
    for make in inputs:
        expected = plain(**make(), return_dict=False)[0]
        got = sharded(**make(), return_dict=False)[0]
        assert got.shape == expected.shape, (got.shape, expected.shape)
        results.append({"diff": float((got - expected).abs().max()), **seen})
    return results


HANG_TIMEOUT_S = 3


def _hung_peer(rank: int, world: int) -> str | None:
    """Rank 0 runs an attention whose peers never join (a hung rank): the all-to-all must
    fail at the SP group's timeout, not wait forever. Returns rank 0's error message."""
    group = dist.new_group(list(range(world)), backend="gloo",
                           timeout=datetime.timedelta(seconds=HANG_TIMEOUT_S))
    outcome = None
    if rank == 0:
        x = torch.randn(1, 4, 2, 8)
        try:
            ulysses_attention(x, x, x, SequenceGroup.of(group))
            outcome = "completed without its peers"
        except RuntimeError as e:
            outcome = str(e)
    dist.barrier()  # the "hung" ranks wait here until rank 0 gave up
    return outcome


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    join_group("gloo", rank, world, port, timeout_s=120)
    try:
        sp = SequenceGroup.of(dist.new_group(list(range(world)), backend="gloo"))
        results: dict[str, Any] = {name: _check(build, inputs, sp)
                                   for name, (build, inputs) in CASES.items()}
        results["hung_peer"] = _hung_peer(rank, world)
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()
