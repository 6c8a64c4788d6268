"""GGUF quantization for ``model convert``: Q4_K bytes (ditserve's quantizer; gguf-py has none)
decode through gguf-py's own dequantizer to within the format's step, exactly where the input
is representable; Q8_0 is gguf-py's. ``GGUFBlockLinear`` computes what diffusers' dequantizer
gives for the same bytes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from ditserve.engine.errors import FormatError
from ditserve.engine.formats.gguf_quant import Q4_K_BLOCK_BYTES, QK_K, quantize, quantize_q4_k

Q4_K = gguf.GGMLQuantizationType.Q4_K


def test_q4_k_round_trips_through_gguf_dequantize_within_half_a_step() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 2 * QK_K)) * 0.05).astype(np.float32)
    packed = quantize_q4_k(x)
    assert packed.shape == (16, 2 * Q4_K_BLOCK_BYTES) and packed.dtype == np.uint8
    y = gguf.quants.dequantize(packed, Q4_K)
    assert y.shape == x.shape
    # Per 32-value sub-block the codes are 16 levels over [min(x, 0), max(x)]: the error is
    # half a level plus the 6-bit rounding of the sub-block's scale and min.
    sub = x.reshape(-1, 32)
    span = (sub.max(1) - np.minimum(sub.min(1), 0))[:, None]
    err = np.abs(y - x).reshape(-1, 32)
    assert (err <= span / 15 * 0.5 + span / 63 * 1.5 + 1e-6).all()
    rel = np.sqrt(((y - x) ** 2).mean()) / x.std()
    assert rel < 0.1  # about Q4's usual 7-9 % relative RMS error


def test_q4_k_is_exact_on_representable_values() -> None:
    # codes 0..15 times a step of 63 x an f16-exact d (the largest 6-bit scale), min 0:
    # every value is a code exactly.
    codes = np.tile(np.arange(16, dtype=np.float32), QK_K // 16 * 4).reshape(4, QK_K)
    x = codes * np.float32(63 / 1024)
    y = gguf.quants.dequantize(quantize_q4_k(x), Q4_K)
    np.testing.assert_array_equal(y, x)


def test_q4_k_zero_and_constant_blocks() -> None:
    x = np.zeros((2, QK_K), dtype=np.float32)
    x[1] = -0.5
    y = gguf.quants.dequantize(quantize_q4_k(x), Q4_K)
    np.testing.assert_allclose(y, x, atol=1e-3)


def test_rows_must_fit_the_block() -> None:
    with pytest.raises(FormatError, match="multiple of 256"):
        quantize(np.zeros((2, 128), dtype=np.float32), "Q4_K")
    with pytest.raises(FormatError, match="multiple of 32"):
        quantize(np.zeros((2, 48), dtype=np.float32), "Q8_0")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_block_linear_equals_diffusers_dequantization(qtype: str) -> None:
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    from ditserve.engine.formats.gguf_linear import GGUFBlockLinear
    from ditserve.engine.weights.dit_file import gguf_quant

    rng = np.random.default_rng(1)
    w = (rng.standard_normal((8, QK_K)) * 0.1).astype(np.float32)
    packed = torch.from_numpy(quantize(w, qtype))
    q = gguf.GGMLQuantizationType[qtype]
    layer = GGUFBlockLinear(QK_K, 8, weight_q=packed, quant=gguf_quant(q), bias=None,
                            compute_dtype=torch.float32)
    expected = dequantize_gguf_tensor(GGUFParameter(packed, quant_type=q))
    assert torch.equal(layer.dequantized_weight(), expected)
    # diffusers' dequantizers compute in the blocks' f16 scale dtype: gguf-py's fp32 result
    # to f16 precision (Q4_K's d * sc * q - dmin * m cancels in f16: a few 1e-4 here)
    np.testing.assert_allclose(layer.dequantized_weight().float().numpy(),
                               gguf.quants.dequantize(packed.numpy(), q), rtol=2e-3, atol=5e-4)
    x = torch.randn(3, QK_K)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, expected.float()))
