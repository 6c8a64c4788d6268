"""Lossless packed bf16 on CPU: exact round trips of every kind of bit pattern, sizes, shards."""

from __future__ import annotations

import json

import pytest
import torch

from ditserve.engine.errors import FormatError
from ditserve.engine.formats.packed_decode import decode, decode_into
from ditserve.engine.formats.packed_encode import encode
from ditserve.engine.formats.packed_layout import PackedBf16, PackedLayout

# Small tiles and groups so a few thousand values exercise many tiles, groups and stripes.
SMALL = dict(tile=64, tiles_per_group=2)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int16)


def assert_round_trip(values: torch.Tensor, **kwargs: int) -> PackedBf16:
    packed = encode(values, **kwargs)
    assert torch.equal(bits(decode(packed)), bits(values))
    return packed


def from_bits(pattern: list[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(pattern, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def test_random_weights_round_trip_at_three_quarters_of_the_bytes() -> None:
    torch.manual_seed(0)
    values = (torch.randn(1 << 20) * 0.02).to(torch.bfloat16)
    packed = assert_round_trip(values)
    assert packed.layout.numel == values.numel()
    # 12 bits a value, plus tables, tile starts, escapes and record padding.
    assert 0.75 <= packed.layout.ratio < 0.7525
    assert packed.layout.escapes < 1e-3 * values.numel()
    assert packed.data.numel() == packed.layout.nbytes


@pytest.mark.parametrize("numel", [0, 1, 7, 63, 64, 65, 1000, 4097])
@pytest.mark.parametrize("stripes", [1, 3, 8])
def test_odd_lengths_and_stripe_counts(numel: int, stripes: int) -> None:
    torch.manual_seed(numel)
    values = torch.randn(numel).to(torch.bfloat16)
    packed = assert_round_trip(values, stripes=stripes, **SMALL)
    assert packed.layout.stripes == stripes


def test_more_than_fifteen_exponents_in_a_group_escape_exactly() -> None:
    torch.manual_seed(1)
    # Magnitudes over ~80 binades: far more exponents than a table holds.
    values = (torch.randn(20_000) * torch.exp2(torch.randint(-40, 40, (20_000,)).float()))
    packed = assert_round_trip(values.to(torch.bfloat16), stripes=4, **SMALL)
    assert packed.layout.escapes > 0.1 * values.numel()


def test_all_escape_group() -> None:
    # 64 values, each with its own exponent: a 15-entry table cannot cover 49 of them.
    pattern = [(e << 7) | (e % 128) for e in range(1, 255, 4)][:64]
    values = from_bits(pattern)
    packed = assert_round_trip(values, stripes=1, **SMALL)
    assert packed.layout.escapes == len(set(pattern)) - 15


def test_special_values_keep_their_bits() -> None:
    specials = [
        0x0000, 0x8000,  # +0, -0
        0x0001, 0x807F, 0x0040,  # subnormals (exponent 0, mantissa != 0)
        0x7F80, 0xFF80,  # +inf, -inf
        0x7FC0, 0xFFC1, 0x7F81, 0x7FFF, 0xFFAA,  # NaNs with different payloads and signs
        0x0080, 0x7F7F, 0xFF7F,  # smallest normal, largest finite of both signs
    ]
    values = from_bits(specials * 50)  # enough repeats to fill tables and several tiles
    assert_round_trip(values, stripes=2, **SMALL)
    assert_round_trip(from_bits(specials), stripes=1, **SMALL)


def test_all_zero_and_constant_runs() -> None:
    assert_round_trip(torch.zeros(5000, dtype=torch.bfloat16), **SMALL)
    assert_round_trip(torch.full((5000,), -0.0, dtype=torch.bfloat16), **SMALL)
    assert_round_trip(torch.full((5000,), 3.5, dtype=torch.bfloat16), **SMALL)


def test_every_bf16_bit_pattern_round_trips() -> None:
    values = from_bits(torch.arange(1 << 16))
    assert_round_trip(values, stripes=8)
    assert_round_trip(values[torch.randperm(1 << 16, generator=torch.Generator().manual_seed(0))],
                      stripes=4, **SMALL)


def test_decode_into_a_view_of_a_larger_buffer() -> None:
    values = torch.randn(3000).to(torch.bfloat16)
    packed = encode(values, **SMALL)
    slot = torch.full((4000,), 7.0, dtype=torch.bfloat16)
    decode_into(packed, slot[500:3500])
    assert torch.equal(bits(slot[500:3500]), bits(values))
    assert (slot[:500] == 7).all() and (slot[3500:] == 7).all()  # nothing written outside


def test_encode_is_deterministic_and_fills_a_given_buffer() -> None:
    values = torch.randn(10_000).to(torch.bfloat16)
    first = encode(values, **SMALL)
    given: list[torch.Tensor] = []

    def allocate(nbytes: int) -> torch.Tensor:
        given.append(torch.full((nbytes,), 0xAB, dtype=torch.uint8))
        return given[0]

    second = encode(values, allocate=allocate, **SMALL)
    assert second.data.data_ptr() == given[0].data_ptr()
    assert torch.equal(first.data, second.data)  # padding zeroed: same bytes, stable digests


def test_layout_survives_json_and_rejects_other_versions() -> None:
    packed = encode(torch.randn(1000).to(torch.bfloat16), **SMALL)
    data = json.loads(json.dumps(packed.layout.to_dict()))
    assert PackedLayout.from_dict(data) == packed.layout
    with pytest.raises(FormatError, match="rebuild"):
        PackedLayout.from_dict({**data, "version": 99})
    with pytest.raises(FormatError, match="not a packed"):
        PackedLayout.from_dict({"numel": 3})


def test_shards_are_stripe_ranges_that_gather_to_the_whole_buffer() -> None:
    values = torch.randn(50_000).to(torch.bfloat16)
    packed = encode(values, stripes=8, **SMALL)
    for group in (1, 2, 4, 8):
        shards = [packed.shard(r, group) for r in range(group)]
        assert {s.numel() for s in shards} == {packed.layout.nbytes // group}
        gathered = torch.cat(shards)  # what all_gather_into_tensor builds, rank order
        assert torch.equal(bits(decode(packed.with_data(gathered))), bits(values))
    with pytest.raises(FormatError, match="stripes a multiple of 3"):
        packed.shard(0, 3)


def test_misuse_is_refused_with_a_fix() -> None:
    with pytest.raises(FormatError, match="bfloat16"):
        encode(torch.randn(10))
    packed = encode(torch.randn(100).to(torch.bfloat16), **SMALL)
    with pytest.raises(FormatError, match="holds 99 values"):
        decode_into(packed, torch.empty(99, dtype=torch.bfloat16))
    with pytest.raises(FormatError, match="bfloat16"):
        decode_into(packed, torch.empty(100, dtype=torch.float16))
    with pytest.raises(FormatError, match="needs"):
        PackedBf16(packed.layout, packed.data[:-1])


def test_corrupt_escape_codes_are_detected() -> None:
    packed = encode(torch.randn(1000).to(torch.bfloat16), stripes=1, **SMALL)
    data = packed.data.clone()
    data[packed.layout.codes_offset] = 0xFF  # two more escape codes than recorded
    with pytest.raises(FormatError, match="corrupt"):
        decode(packed.with_data(data))
