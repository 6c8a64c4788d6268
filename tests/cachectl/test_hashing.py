"""Piece hashing: the same digests from files and from memory, whatever the thread count or
the way spans are grouped, so one large file is hashed on every core."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from ditserve.cachectl.digests import over_pieces, tensor_digests
from ditserve.cachectl.hashing import Span, hash_buffers, hash_spans, piece_ranges


def _expected(data: bytes, piece: int) -> list[bytes]:
    return [hashlib.sha256(data[s:s + n]).digest() for s, n in piece_ranges(len(data), piece)]


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_file_spans_hash_to_the_pieces_of_their_bytes(tmp_path: Path, threads: int) -> None:
    data = os.urandom(1_000_003)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    piece = 64 * 1024
    # Back-to-back spans (grouped into shared work items), one large, one empty, one odd.
    spans = [Span(path, 0, 10, "head"), Span(path, 10, 700_000, "big"),
             Span(path, 700_010, 0, "empty"), Span(path, 700_010, 299_993, "tail")]
    got = hash_spans(spans, piece_bytes=piece, threads=threads)
    assert got["head"] == _expected(data[:10], piece)
    assert got["big"] == _expected(data[10:700_010], piece) and len(got["big"]) == 11
    assert got["empty"] == []
    assert got["tail"] == _expected(data[700_010:], piece)


def test_a_span_past_the_end_of_its_file_is_an_error_not_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    got = hash_spans([Span(path, 0, 50, "ok"), Span(path, 90, 20, "past")], piece_bytes=64)
    assert isinstance(got["past"], OSError) and "shorter than expected" in str(got["past"])
    missing = hash_spans([Span(tmp_path / "gone.bin", 0, 10, "x")])
    assert isinstance(missing["x"], FileNotFoundError)


def test_buffers_and_files_agree(tmp_path: Path) -> None:
    arrays = {"a": np.arange(100_000, dtype=np.float32), "b": np.zeros(3, dtype=np.int64),
              "c": np.zeros(0, dtype=np.float16)}
    views = {n: memoryview(a.tobytes()) for n, a in arrays.items()}
    mem = hash_buffers(views, piece_bytes=4096, threads=4)
    path = tmp_path / "all.bin"
    path.write_bytes(b"".join(bytes(v) for v in views.values()))
    spans, offset = [], 0
    for n, v in views.items():
        spans.append(Span(path, offset, v.nbytes, n))
        offset += v.nbytes
    assert hash_spans(spans, piece_bytes=4096, threads=2) == mem
    digests = tensor_digests(arrays, piece_bytes=4096)
    assert digests["a"] == ("F32", (100_000,), over_pieces(mem["a"]))
    assert digests["c"][2] == hashlib.sha256(b"").hexdigest()
