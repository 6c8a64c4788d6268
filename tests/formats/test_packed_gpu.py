"""The Triton decoder of packed bf16 on a CUDA device: bit-exact against the CPU decoder, on
the caller's stream, into the caller's tensor, without allocating or syncing the host."""

from __future__ import annotations

import functools

import pytest
import torch

from ditserve.engine.formats.packed_decode import decode, decode_into
from ditserve.engine.formats.packed_encode import encode

pytestmark = pytest.mark.gpu


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int16)


@functools.cache  # collected in CPU runs too: build the inputs once
def cases() -> list[tuple[str, torch.Tensor, dict[str, int]]]:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(30_000, generator=g) * torch.exp2(
        torch.randint(-60, 60, (30_000,), generator=g).float())
    return [
        ("weights", (torch.randn(3_000_001, generator=g) * 0.02).to(torch.bfloat16), {}),
        ("every-pattern", torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
         .view(torch.bfloat16), {"stripes": 8}),
        ("wide-exponents", wide.to(torch.bfloat16), {"tile": 256, "tiles_per_group": 2}),
        ("odd-length", torch.randn(4097, generator=g).to(torch.bfloat16),
         {"stripes": 3, "tile": 64, "tiles_per_group": 4}),
        ("zeros", torch.zeros(10_000, dtype=torch.bfloat16), {}),
    ]


@pytest.mark.parametrize("name,values,kwargs", cases(), ids=[c[0] for c in cases()])
def test_triton_decode_equals_cpu_decode(name: str, values: torch.Tensor,
                                         kwargs: dict[str, int]) -> None:
    packed = encode(values, **kwargs)
    on_gpu = packed.with_data(packed.data.cuda())
    got = decode(on_gpu)
    torch.cuda.synchronize()
    assert torch.equal(bits(got.cpu()), bits(decode(packed)))
    assert torch.equal(bits(got.cpu()), bits(values))


def test_decode_on_a_side_stream_into_a_slot_without_allocation_or_host_sync() -> None:
    values = (torch.randn(1 << 22) * 0.05).to(torch.bfloat16)
    packed = encode(values)
    staging = torch.empty(packed.layout.nbytes + 512, dtype=torch.uint8, device="cuda")
    staging[256 : 256 + packed.layout.nbytes].copy_(packed.data)  # an aligned slot offset
    on_gpu = packed.with_data(staging[256 : 256 + packed.layout.nbytes])
    slot = torch.zeros(values.numel() + 1024, dtype=torch.bfloat16, device="cuda")
    target = slot[512 : 512 + values.numel()]
    decode_into(on_gpu, target)  # warm-up: compiles the kernel
    target.zero_()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    before = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
    try:
        with torch.cuda.stream(stream):
            decode_into(on_gpu, target)
            done = torch.cuda.Event()
            done.record(stream)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.cuda.memory_allocated() == before
    done.synchronize()
    assert torch.equal(bits(target.cpu()), bits(values))
    assert not slot[:512].any() and not slot[512 + values.numel():].any()


@pytest.mark.parametrize("name,values,kwargs", cases(), ids=[c[0] for c in cases()])
def test_encode_on_cuda_gives_the_cpu_bytes(name: str, values: torch.Tensor,
                                            kwargs: dict[str, int]) -> None:
    on_cpu = encode(values, **kwargs)
    on_cuda = encode(values.cuda(), **kwargs)
    assert on_cuda.layout == on_cpu.layout
    assert on_cuda.data.device.type == "cpu"  # the default allocator: host bytes
    assert torch.equal(on_cuda.data, on_cpu.data)
