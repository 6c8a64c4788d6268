"""Slot codecs (``formats.slot_codecs``): the GGUF codec writes exactly the weights
``GGUFBlockLinear`` computes with; its constant cache changes no bit and makes each constant
once; bad pairs are refused at bind; the packed codec decodes as ``decode_into`` does."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from ditserve.engine.errors import FormatError
from ditserve.engine.formats.gguf_linear import GGUFBlockLinear
from ditserve.engine.formats.gguf_quant import quantize
from ditserve.engine.formats.packed_decode import decode
from ditserve.engine.formats.packed_encode import encode
from ditserve.engine.formats.slot_codecs import DeviceConstants, GGUFCodec, GGUFRun, PackedCodec
from ditserve.engine.weights.dit_file import gguf_quant


def layer(qtype: str, rows: int, cols: int, seed: int) -> GGUFBlockLinear:
    rng = np.random.default_rng(seed)
    data = quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    return GGUFBlockLinear(cols, rows, weight_q=torch.from_numpy(data),
                           quant=gguf_quant(gguf.GGMLQuantizationType[qtype]), bias=None,
                           compute_dtype=torch.bfloat16)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q4_0", "Q5_1"])
def test_gguf_codec_writes_the_layers_own_weights(qtype: str) -> None:
    layers = [layer(qtype, 64, 512, 0), layer(qtype, 32, 256, 1)]
    staged = torch.cat([m.weight_q.reshape(-1) for m in layers])
    first = layers[0].weight_q.numel()
    runs = (GGUFRun(0, first, layers[0].quant, 64, 512, 0),
            GGUFRun(first, layers[1].weight_q.numel(), layers[1].quant, 32, 256, 64 * 512 + 128))
    codec = GGUFCodec(runs, torch.bfloat16)
    out = torch.full((codec.numel,), float("nan"), dtype=torch.bfloat16)
    codec.bind(staged, out)()
    for m, run in zip(layers, runs, strict=True):
        want = m.dequantized_weight().to(torch.bfloat16)
        got = out[run.out_offset : run.out_offset + run.numel].view(run.rows, run.cols)
        assert torch.equal(got, want)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_K", "Q4_0"])
def test_cached_constants_change_no_bit_and_are_made_once(qtype: str) -> None:
    m = layer(qtype, 16, 256, 2) if qtype not in ("Q6_K", "Q5_K") else None
    if m is None:  # gguf-py has no quantizer for these: random bytes decode all the same
        q = gguf_quant(gguf.GGMLQuantizationType[qtype])
        blocks = torch.randint(0, 256, (16, q.type_size), dtype=torch.uint8)
        blocks[:, :2] = 0x10  # keep the f16 scales finite (any bytes would do for equality)
    else:
        q = m.quant
        blocks = m.weight_q.reshape(-1, q.type_size)
    want = q.dequantize(blocks, q.block_size, q.type_size)
    with DeviceConstants():
        got = q.dequantize(blocks, q.block_size, q.type_size)
        a = torch.tensor([0, 4], dtype=torch.uint8, device="cpu")
        b = torch.tensor([0, 4], dtype=torch.uint8, device="cpu")
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    assert a is b  # one tensor per (values, dtype, device)
    assert torch.tensor([0, 4], dtype=torch.uint8) is not a  # outside: ordinary calls


def test_gguf_codec_refuses_targets_it_cannot_fill() -> None:
    m = layer("Q8_0", 8, 64, 3)
    staged = m.weight_q.reshape(-1)
    codec = GGUFCodec((GGUFRun(0, staged.numel(), m.quant, 8, 64, 0),), torch.bfloat16)
    with pytest.raises(FormatError, match="bfloat16"):
        codec.bind(staged, torch.empty(8 * 64, dtype=torch.float32))
    with pytest.raises(FormatError, match="holds 10 values"):
        codec.bind(staged, torch.empty(10, dtype=torch.bfloat16))
    with pytest.raises(FormatError, match="reach byte"):
        codec.bind(staged[:-1], torch.empty(8 * 64, dtype=torch.bfloat16))


def test_packed_codec_decodes_as_decode_into() -> None:
    values = (torch.randn(4096) * 0.02).to(torch.bfloat16)
    packed = encode(values)
    out = torch.empty_like(values)
    PackedCodec(packed.layout).bind(packed.data, out)()
    assert torch.equal(out, values) and torch.equal(decode(packed), values)
    with pytest.raises(FormatError):
        PackedCodec(packed.layout).bind(packed.data, torch.empty(10, dtype=torch.bfloat16))
