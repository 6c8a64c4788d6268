"""Wan blocks with sliced token-wise math: diffusers' outputs bit for bit (float32 math in
slices) or within rounding (the feed-forward in slices too), with less memory."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import WanTransformer3DModel

from ditserve.engine.families.wan.block import chunk_token_math, token_slices


def tiny_wan(**overrides) -> WanTransformer3DModel:
    torch.manual_seed(0)
    config = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                  text_dim=24, freq_dim=32, ffn_dim=48, num_layers=2, rope_max_seq_len=64,
                  cross_attn_norm=True)
    return WanTransformer3DModel(**(config | overrides)).eval()


def inputs(rows: int, per_token_timesteps: bool = False):
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(rows, 4, 3, 8, 12, generator=g)  # 3 x 4 x 6 = 72 tokens per row
    text = torch.randn(rows, 7, 24, generator=g)
    if per_token_timesteps:  # Wan 2.2 TI2V: a timestep per latent token
        timestep = torch.randint(0, 1000, (rows, 72), generator=g)
    else:
        timestep = torch.tensor([999, 500, 1][:rows])
    return latents, timestep, text


@pytest.mark.parametrize("chunk_rows", [1, 7, 50, 144, 10_000])
@pytest.mark.parametrize("per_token", [False, True], ids=["wan2.1", "ti2v-timesteps"])
def test_sliced_blocks_match_diffusers_bit_for_bit(chunk_rows: int, per_token: bool) -> None:
    stock = tiny_wan()
    sliced = copy.deepcopy(stock)
    assert chunk_token_math(sliced, chunk_rows=chunk_rows, ffn_chunk_rows=None) == 2
    latents, timestep, text = inputs(rows=2, per_token_timesteps=per_token)
    with torch.inference_mode():
        want = stock(latents, timestep, text, return_dict=False)[0]
        got = sliced(latents, timestep, text, return_dict=False)[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("ffn_chunk_rows", [1, 30, 144])
def test_a_sliced_feed_forward_matches_within_rounding(ffn_chunk_rows: int) -> None:
    stock = tiny_wan()
    sliced = copy.deepcopy(stock)
    chunk_token_math(sliced, chunk_rows=50, ffn_chunk_rows=ffn_chunk_rows)
    latents, timestep, text = inputs(rows=2, per_token_timesteps=True)
    with torch.inference_mode():
        want = stock(latents, timestep, text, return_dict=False)[0]
        got = sliced(latents, timestep, text, return_dict=False)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_blocks_match_too() -> None:
    stock = tiny_wan().to(torch.bfloat16)
    sliced = copy.deepcopy(stock)
    chunk_token_math(sliced, chunk_rows=40, ffn_chunk_rows=None)
    latents, timestep, text = inputs(rows=3)
    with torch.inference_mode():
        want = stock(latents.bfloat16(), timestep, text.bfloat16(), return_dict=False)[0]
        got = sliced(latents.bfloat16(), timestep, text.bfloat16(), return_dict=False)[0]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_slices_cover_every_token_once_at_about_the_row_budget() -> None:
    for rows, tokens, budget in [(1, 10, 4), (3, 10, 7), (8, 14040, 16384), (2, 5, 1000)]:
        slices = list(token_slices(rows, tokens, budget))
        covered = [t for s in slices for t in range(s.start, s.stop)]
        assert covered == list(range(tokens))
        assert all((s.stop - s.start) * rows <= max(budget, rows) for s in slices)


def test_a_block_with_another_signature_keeps_its_forward(caplog) -> None:
    class OtherBlock(torch.nn.Module):
        def forward(self, x, extra):
            return x

    class OtherDit(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([OtherBlock()])

    dit = OtherDit()
    assert chunk_token_math(dit) == 0
    assert "forward" not in vars(dit.blocks[0])
    assert "stays whole-sequence" in caplog.text


def test_the_wan_pipeline_serves_sliced_blocks(family_runner) -> None:
    runner = family_runner("wan")
    blocks = runner.pipeline.experts[0].blocks
    assert all("forward" in vars(block) for block in blocks)


@pytest.mark.gpu
def test_on_cuda_sliced_blocks_match_and_peak_lower() -> None:
    device = torch.device("cuda")
    stock = tiny_wan(num_attention_heads=4, attention_head_dim=64, ffn_dim=704, num_layers=1,
                     rope_max_seq_len=1024).to(device, torch.bfloat16)
    exact = copy.deepcopy(stock)
    chunk_token_math(exact, chunk_rows=4096, ffn_chunk_rows=None)
    sliced = copy.deepcopy(stock)
    chunk_token_math(sliced, chunk_rows=4096, ffn_chunk_rows=4096)
    g = torch.Generator(device).manual_seed(3)
    # 4 rows x (9 x 30 x 52) tokens: a 33-frame 832x480 video's token grid, CFG, two jobs.
    latents = torch.randn(4, 4, 9, 60, 104, generator=g, device=device, dtype=torch.bfloat16)
    text = torch.randn(4, 7, 24, generator=g, device=device, dtype=torch.bfloat16)
    timestep = torch.tensor([999, 999, 400, 400], device=device)

    def run(model):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.inference_mode():
            out = model(latents, timestep, text, return_dict=False)[0]
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - before

    want, stock_peak = run(stock)
    same, exact_peak = run(exact)
    got, sliced_peak = run(sliced)
    assert torch.equal(same, want)
    # The sliced feed-forward's matmuls round differently by an ulp or so of bf16 (outputs
    # are O(1)); what is checked is that no element moved further than that.
    assert (got.float() - want.float()).abs().max().item() <= 0.05
    assert sliced_peak < exact_peak < stock_peak, (sliced_peak, exact_peak, stock_peak)
