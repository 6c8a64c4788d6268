"""Cosmos3's DiT and runner on the tiny model: what it refuses and leaves out (a sound
track elsewhere, the step cache, the safety checker), its sequence-parallel rule, its token
math sliced, its memory plan, FP8 layers streamed by DLO."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine.driver import drive  # type: ignore[import-not-found]
from families.cosmos3_support import CASES, VARIANT  # type: ignore[import-not-found]
from families.family_support import open_runner  # type: ignore[import-not-found]

from ditserve.engine.config import OffloadConfig, PipelineConfig, ResolvedOffload, SchedulerConfig
from ditserve.engine.errors import InvalidRequestError
from ditserve.engine.request import SamplingParams


def test_audio_refused_without_sound(family_runner) -> None:  # type: ignore[no-untyped-def]
    # Another family's model has no sound track: the request is refused at the edge.
    limits = family_runner("wan").limits
    with pytest.raises(InvalidRequestError, match="audio"):
        SamplingParams(prompt="x", num_frames=5, audio=True).validate_for(limits)
    assert family_runner(VARIANT).limits.audio


def test_step_cache_is_refused_with_the_reason(family_runner) -> None:  # type: ignore[no-untyped-def]
    from ditserve.engine.config.step_cache import StepCacheSpec

    runner = family_runner(VARIANT)
    assert runner.step_cache.policies == ()
    with pytest.raises(InvalidRequestError, match="packed"):
        runner.step_cache.check(StepCacheSpec(policy="first-block"))


def test_a_model_that_asks_for_the_safety_checker_loads_without_it(family_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A released model_index.json may name the guardrail (a package ditserve does not
    # install) and turn it on: the loader leaves it out instead of failing.
    import json
    import shutil

    from ditserve.engine.weights.loader import load_components

    model = tmp_path / "released-like"
    shutil.copytree(family_dir(VARIANT), model)
    index = json.loads((model / "model_index.json").read_text())
    index.update(enable_safety_checker=True,
                 safety_checker=["cosmos_guardrail", "CosmosSafetyChecker"])
    (model / "model_index.json").write_text(json.dumps(index))
    loaded = load_components(model)
    assert loaded.pipeline.safety_checker is None
    assert loaded.config["enable_safety_checker"] is False


def test_operator_judges_sp_by_the_key_value_heads() -> None:
    # Ulysses splits Cosmos3's 8 key-value heads: 8 ranks serve, 16 serve none of its models.
    from ditserve.engine.config.rules import family_sequence_parallel_problems

    assert family_sequence_parallel_problems(8, "Cosmos3") == []
    (problem,) = family_sequence_parallel_problems(16, "Cosmos3")
    assert "use one of 1, 2, 4, 8" in problem


def test_sliced_token_math_equals_whole(family_dir) -> None:  # type: ignore[no-untyped-def]
    # Slices of 3 tokens (the tiny sequences are tens long): the feed-forwards and the RoPE
    # run slice by slice and give the whole-sequence forward's result.
    from ditserve.engine.families.cosmos3 import block, packing
    from ditserve.engine.weights.loader import load_dit

    dit: Any = load_dit(family_dir(VARIANT), dtype="float32")
    dit.set_attn_processor(packing.PackedItemsProcessor())
    g = torch.Generator().manual_seed(0)
    und, gen = torch.randn(40, 32, generator=g), torch.randn(24, 32, generator=g)
    rope = tuple(torch.randn(n, 16, generator=g) for n in (40, 40, 24, 24))
    layer = dit.layers[0]
    whole = layer(und, gen, rope)
    block.chunk_token_math(dit, chunk_tokens=3)
    saved = packing.ROPE_CHUNK_TOKENS
    packing.ROPE_CHUNK_TOKENS = 3
    try:
        sliced = layer(und, gen, rope)
    finally:
        packing.ROPE_CHUNK_TOKENS = saved
    for a, b in zip(whole, sliced, strict=True):
        assert (a - b).abs().max().item() <= 1e-5


def test_sliced_token_math_never_upcasts_a_whole_sequence(family_dir) -> None:  # type: ignore[no-untyped-def]
    # diffusers' RMSNorm works in float32: over a 720p step's 88k tokens its copies of the
    # queries were the layer's largest tensors. Sliced, no float32 tensor spans a pathway.
    from torch.utils._python_dispatch import TorchDispatchMode

    from ditserve.engine.families.cosmos3 import block, packing
    from ditserve.engine.weights.loader import load_dit

    class Float32Rows(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.rows: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim():
                    self.rows.add(int(t.shape[0]))
            return out

    dit: Any = load_dit(family_dir(VARIANT), dtype="bfloat16")
    dit.set_attn_processor(packing.PackedItemsProcessor())
    block.chunk_token_math(dit, chunk_tokens=3)
    g = torch.Generator().manual_seed(0)
    und, gen = (torch.randn(n, 32, generator=g).to(torch.bfloat16) for n in (40, 24))
    rope = tuple(torch.randn(n, 16, generator=g).to(torch.bfloat16) for n in (40, 40, 24, 24))
    with torch.no_grad(), Float32Rows() as seen:
        dit.layers[0](und, gen, rope)
    assert seen.rows and not seen.rows & {40, 24}


def test_memory_plan_leaves_the_host_modules_out(family_runner) -> None:  # type: ignore[no-untyped-def]
    # The planner's resident DiT bytes are the tensors outside the layers and outside the
    # token table and LM head, which never reach the device.
    from ditserve.engine.placement.memory_estimates import budget_inputs

    runner = family_runner(VARIANT)
    dit: Any = runner.pipeline.transformer
    skipped = {id(t) for m in (dit.layers, dit.embed_tokens, dit.lm_head)
               for t in (*m.parameters(), *m.buffers())}
    resident = sum(t.numel() * t.element_size() for t in (*dit.parameters(), *dit.buffers())
                   if id(t) not in skipped)
    inputs = budget_inputs(runner.pipeline, scheduler=SchedulerConfig(),
                           pipeline_config=PipelineConfig(), offload=ResolvedOffload())
    assert inputs.dit_fixed == resident


def fp8_run(model: Any, device: str, offload: OffloadConfig) -> dict[str, torch.Tensor]:
    """Two requests (one with CFG) sharing steps, bfloat16 with ``--quantization fp8``."""
    from ditserve.engine.formats.fp8_linear import FP8Linear

    with open_runner(model, device=device, dtype="bfloat16", quantization="fp8",
                     offload=offload) as runner:
        # The tiny layers' attention projections (multiples of 16) are FP8; its MLP is not.
        assert any(isinstance(m, FP8Linear) for m in runner.pipeline.transformer.modules())
        requests = [(rid, CASES[rid]) for rid in ("t2v-cfg", "t2i")]
        out, sizes = drive(runner, {0: requests}, max_num_seqs=2)
    assert max(sizes) == 2
    return out


def test_fp8_dlo_equals_resident_fp8(family_dir) -> None:  # type: ignore[no-untyped-def]
    # The Super-sized DiT's bench streams FP8 layers: DLO of FP8 blocks == resident FP8.
    model = family_dir(VARIANT)
    resident = fp8_run(model, "cpu", OffloadConfig())
    offloaded = fp8_run(model, "cpu", OffloadConfig(enabled=True))
    assert set(resident) == set(offloaded)
    for rid in resident:
        assert torch.equal(offloaded[rid], resident[rid]), rid


@pytest.mark.gpu
def test_on_cuda_fp8_dlo_equals_resident_fp8(family_dir) -> None:  # type: ignore[no-untyped-def]
    model = family_dir(VARIANT)
    resident = fp8_run(model, "cuda", OffloadConfig())
    offloaded = fp8_run(model, "cuda", OffloadConfig(enabled=True, checkpoint_mmap="off"))
    for rid in resident:
        assert torch.equal(offloaded[rid], resident[rid]), rid
