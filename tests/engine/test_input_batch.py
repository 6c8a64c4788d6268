"""InputBatch: gather/scatter round trips over random request mixes, padding, buffer reuse."""

from __future__ import annotations

import random

import pytest
import torch

from ditserve.engine.errors import BatchMismatchError
from ditserve.engine.request import SamplingParams
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step.input_batch import InputBatchBuilder
from ditserve.engine.step.sampler import Schedule


def make_state(rid: str, rng: random.Random, *, seq_len: int = 8) -> DenoiseState:
    n = rng.randint(1, 3)
    cfg = rng.random() < 0.5
    params = SamplingParams(prompt=rid, num_images=n, negative_prompt="neg" if cfg else None,
                            true_cfg_scale=2.0 if cfg else 1.0, num_inference_steps=5)
    state = DenoiseState(rid, params, seed=0)
    rows = params.rows
    state.static_rows = {
        "encoder_hidden_states": torch.randn(rows, seq_len, 4),
        "pooled_projections": torch.randn(rows, 3),
    }
    state.latents = torch.randn(n, 6, 2)
    state.schedule = Schedule(timesteps=torch.linspace(1000, 100, 5), sigmas=torch.linspace(1, 0, 6))
    state.step_index = rng.randint(0, 4)
    return state


def test_round_trip_over_random_mixes() -> None:
    rng = random.Random(0)
    builder = InputBatchBuilder()
    for trial in range(20):
        states = [make_state(f"t{trial}r{i}", rng) for i in range(rng.randint(1, 5))]
        batch = builder.build(states)
        assert batch.num_rows == sum(s.rows for s in states)
        for state, rows in zip(states, batch.split(batch.hidden_states), strict=True):
            n = state.params.num_images
            # Every row of a request holds its latents; CFG rows repeat them.
            assert torch.equal(rows[:n], state.latents)
            if state.params.uses_true_cfg:
                assert torch.equal(rows[n:], state.latents)
        for state, emb in zip(states, batch.split(batch.static["encoder_hidden_states"]), strict=True):
            assert torch.equal(emb, state.static_rows["encoder_hidden_states"])
        for state, ts in zip(states, batch.split(batch.timesteps), strict=True):
            assert torch.all(ts == state.current_timestep())


def test_static_rows_and_buffers_reused_while_composition_is_unchanged() -> None:
    rng = random.Random(1)
    builder = InputBatchBuilder()
    states = [make_state(f"r{i}", rng) for i in range(3)]
    first = builder.build(states)
    for s in states:
        s.latents = s.latents + 1
        s.step_index = min(s.step_index + 1, 4)
    second = builder.build(states)
    assert builder.static_rebuilds == 1
    assert second.static["encoder_hidden_states"] is first.static["encoder_hidden_states"]
    assert second.hidden_states.data_ptr() == first.hidden_states.data_ptr()
    # The reused buffer holds the new latents, not stale ones.
    assert torch.equal(second.split(second.hidden_states)[0][: states[0].params.num_images],
                       states[0].latents)
    builder.build(states[:2])
    assert builder.static_rebuilds == 2


def test_sequence_padding_and_mask() -> None:
    rng = random.Random(2)
    short = make_state("short", rng, seq_len=3)
    long = make_state("long", rng, seq_len=7)
    batch = InputBatchBuilder().build([short, long])
    emb = batch.static["encoder_hidden_states"]
    mask = batch.static["encoder_hidden_states_mask"]
    assert emb.shape[1] == 7
    s_rows = batch.row_slices[0]
    assert torch.equal(emb[s_rows, :3], short.static_rows["encoder_hidden_states"])
    assert torch.all(emb[s_rows, 3:] == 0)
    assert mask[s_rows].sum(dim=1).tolist() == [3] * short.rows
    assert bool(mask[batch.row_slices[1]].all())


def test_a_new_request_reusing_a_finished_request_id_gets_its_own_rows() -> None:
    rng = random.Random(3)
    builder = InputBatchBuilder()
    old = make_state("same-id", rng)
    builder.build([old])
    new = make_state("same-id", random.Random(4))
    new_rows = new.rows
    batch = builder.build([new])
    assert builder.static_rebuilds == 2
    assert batch.num_rows == new_rows
    assert torch.equal(batch.static["pooled_projections"], new.static_rows["pooled_projections"])


def test_static_tensors_that_differ_are_refused_either_way_round() -> None:
    # Once a tensor the first request lacked was dropped silently, and the reverse order
    # raised KeyError; both orders now name the requests and the tensors.
    rng = random.Random(5)
    plain, extra = make_state("plain", rng), make_state("extra", rng)
    extra.static_rows["guidance"] = torch.ones(extra.rows)
    for states in ([plain, extra], [extra, plain]):
        with pytest.raises(BatchMismatchError, match="different static tensors") as info:
            InputBatchBuilder().build(states)
        assert "'plain'" in str(info.value) and "'extra'" in str(info.value)
        assert "guidance" in str(info.value)


def test_static_tensors_of_other_dtypes_or_widths_are_refused() -> None:
    rng = random.Random(6)
    a, b = make_state("a", rng), make_state("b", rng)
    b.static_rows["pooled_projections"] = b.static_rows["pooled_projections"].double()
    with pytest.raises(BatchMismatchError, match="'pooled_projections'.*float32.*float64"):
        InputBatchBuilder().build([a, b])
    c = make_state("c", rng)
    c.static_rows["encoder_hidden_states"] = torch.randn(c.rows, 8, 5)  # width 5, not 4
    with pytest.raises(BatchMismatchError, match="only the row count"):
        InputBatchBuilder().build([a, c])


def test_one_input_batch_takes_one_shape_group() -> None:
    rng = random.Random(7)
    a, b = make_state("a", rng), make_state("b", rng)
    b.params = SamplingParams(prompt="b", height=128, width=64)
    with pytest.raises(BatchMismatchError, match="different shape groups"):
        InputBatchBuilder().build([a, b])
