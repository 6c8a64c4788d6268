"""Both ends of a control link in two gloo processes (spawned by test_worker_messages.py)."""

from __future__ import annotations

# Around the frame size: inline, exactly full, one byte over, and far over (pixels).
SIZES = [0, 100, 16 * 1024 - 40, 16 * 1024, 16 * 1024 + 1, 300_000]


def message(size: int) -> dict[str, object]:
    return {"size": size, "bytes": bytes(range(256)) * (size // 256) + bytes(size % 256)}


def run_end(rank: int, port: int) -> None:
    import torch.distributed as dist
    from distributed.rendezvous_support import join_group  # type: ignore[import-not-found]

    from ditserve.engine.distributed.protocol import Link

    join_group("gloo", rank, 2, port, timeout_s=60)
    try:
        pair = dist.new_group([0, 1], backend="gloo")
        link = Link(pair, peer=1 - rank)
        for size in SIZES:
            if rank == 0:
                link.send(message(size))
                assert link.receive() == ("echo", message(size)), size
            else:
                link.send(("echo", link.receive()))
    finally:
        dist.destroy_process_group()
