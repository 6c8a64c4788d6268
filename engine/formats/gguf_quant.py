"""GGUF quantization for ``model convert --to gguf:<type>``: gguf-py's where it has one, and
Q4_K here (gguf 0.19 dequantizes Q4_K but has no quantizer).

Q4_K stores 256 values per 144-byte block: an f16 ``d`` and ``dmin``, twelve bytes packing
eight 6-bit sub-block scales and mins, and 128 bytes of 4-bit codes; a value of sub-block ``j``
is ``d * sc[j] * q - dmin * m[j]``. This quantizer fits each 32-value sub-block's range
(``min(x, 0)`` .. ``max(x)``) to the 16 codes, rounds the sub-block scales and mins to 6 bits
against the block's maxima, and rounds each value to the nearest code under the rounded
scale and min (llama.cpp's ``make_qkx2`` further searches each sub-block's scale; this one does
not, so its error is somewhat larger: see docs/formats.md). The bytes are gguf's layout
exactly: a test round-trips through ``gguf.quants.dequantize``.

Called by ``weights.convert``; pure numpy (no torch).
"""

from __future__ import annotations

import numpy as np

from ditserve.engine.errors import FormatError

QK_K = 256  # values per K-quant block
Q4_K_BLOCK_BYTES = 144


def quantize(data: np.ndarray, qtype_name: str) -> np.ndarray:
    """``data`` (float, last dim a multiple of the type's block) quantized to GGUF's bytes,
    shape (..., last // block * bytes_per_block), as ``gguf.quants.quantize`` returns them."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if data.shape[-1] % block:
        raise FormatError(f"{qtype_name} quantizes rows whose length is a multiple of {block}, "
                          f"got shape {tuple(data.shape)}")
    if qtype_name == "Q4_K":
        return quantize_q4_k(data)
    return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)


def quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """Q4_K bytes of ``data`` (see the module docstring)."""
    values = np.asarray(data, dtype=np.float32)
    if values.shape[-1] % QK_K:
        raise FormatError(f"Q4_K quantizes rows of a multiple of {QK_K} values, got shape "
                          f"{tuple(values.shape)}")
    n = values.size // QK_K
    x = values.reshape(n, 8, 32)  # (blocks, sub-blocks, values)
    low = np.minimum(x.min(axis=-1), 0.0)  # (n, 8), <= 0: Q4_K subtracts a non-negative min
    sub_scale = (x.max(axis=-1) - low) / 15.0
    sub_min = -low
    # The block's f16 scales of the 6-bit sub-block scales and mins.
    d = (sub_scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (sub_min.max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.rint(sub_scale / d32), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin32 > 0, np.rint(sub_min / dmin32), 0).clip(0, 63).astype(np.uint8)
        step = (d32 * sc)[..., None]  # (n, 8, 1): the scale each sub-block decodes with
        offset = (dmin32 * m)[..., None]
        q = np.where(step > 0, np.rint((x + offset) / step), 0).clip(0, 15).astype(np.uint8)
    scales = np.empty((n, 12), dtype=np.uint8)
    # bytes 0-3: scales 0-3 and the high bits of scales 4-7; 4-7: the same for the mins;
    # 8-11: the low nibbles of scales 4-7 (low) and mins 4-7 (high).
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    # 128 bytes: byte k of chunk i holds sub-block 2i's code k (low) and 2i+1's (high).
    codes = q.reshape(n, 4, 2, 32)
    qs = (codes[:, :, 0, :] | (codes[:, :, 1, :] << 4)).reshape(n, 128)
    blocks = np.concatenate(
        [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, qs], axis=1)
    return blocks.reshape(*values.shape[:-1], values.shape[-1] // QK_K * Q4_K_BLOCK_BYTES)
