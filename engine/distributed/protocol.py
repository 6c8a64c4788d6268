"""The control protocol between rank 0 and the worker processes of a replica.

Both sides import this module - rank 0's ``executor`` and the workers' ``worker`` - so the
messages and the one way they travel are defined once. Each worker has a ``Link`` to rank 0:
a gloo group of just {0, r}, on which messages go point to point, one at a time, answered in
order:

    worker -> rank 0   once, after loading:   WorkerHello | WorkerFailure
    rank 0 -> worker   Step                   -> WorkerReply | WorkerFailure
                       Reports                -> WorkerReply (output None)
                       Stop                   (no answer; the worker leaves its loop)

A step of several ranks sends each of them its ``Step``, runs rank 0's own plan, then receives
the replies in rank order; a step of one rank uses only that rank's link. So ranks that step
together (DLO AllGather: their weight loads are collectives) and ranks that step at their own
pace (one step loop per rank, each on its own links) speak the same protocol; only
``Step.collective`` differs. A worker that cannot start or hits an unexpected error answers
with a ``WorkerFailure`` and exits, so rank 0 reports it instead of waiting for a timeout.

Kept light at import time (spawned workers import it first): torch.distributed is imported
on use.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from ditserve.engine.executor import RankWork


@dataclass(frozen=True)
class Step:
    """Run ``work``. collective: this step's weight loads are collectives of the ranks that
    step together and some rank runs a forward, so a rank without a batch still joins them.
    reports: attach this rank's offload report to the reply."""

    work: RankWork
    collective: bool = False
    reports: bool = False


@dataclass(frozen=True)
class Reports:
    """Answer with this rank's offload report and run nothing. Not an idle step: a step waits
    for the runner's queued work and hands back its late outputs (decoded pixels), which a
    report request would drop."""


@dataclass(frozen=True)
class Stop:
    """Rank 0 is shutting down; the worker leaves its loop."""


@dataclass(frozen=True)
class WorkerHello:
    rank: int
    pid: int
    device: str
    pixel_multiple: int
    offload: dict[str, Any] | None


@dataclass(frozen=True)
class WorkerReply:
    output: Any  # RunnerOutput; None for Reports
    offload_report: dict[str, Any] | None = None


@dataclass(frozen=True)
class WorkerFailure:
    rank: int
    pid: int
    message: str


# Every message is one frame of FRAME_BYTES: an 8-byte length, then the pickled message; a
# longer message (a reply with decoded pixels) sends its rest in a second, exact-size send.
# One send per message, not torch's send_object_list (a size tensor, then the payload): a
# gloo send waits for the peer's matching receive, so each send is a round trip, and on 2
# CPU cores the frame took a small step's round trip from ~1-2 ms to ~0.3 ms (best case).
FRAME_BYTES = 16 * 1024
_LENGTH_BYTES = 8
_INLINE_BYTES = FRAME_BYTES - _LENGTH_BYTES


@dataclass(frozen=True)
class Link:
    """One end of the control channel between rank 0 and one worker."""

    group: Any  # the gloo process group of {0, worker}
    peer: int  # the global rank at the other end

    def send(self, message: Any) -> None:
        import torch
        import torch.distributed as dist

        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        length = len(payload).to_bytes(_LENGTH_BYTES, "little")
        frame[:_LENGTH_BYTES] = torch.frombuffer(bytearray(length), dtype=torch.uint8)
        inline = min(len(payload), _INLINE_BYTES)
        frame[_LENGTH_BYTES:_LENGTH_BYTES + inline] = data[:inline]
        dist.send(frame, dst=self.peer, group=self.group)
        if len(payload) > inline:
            dist.send(data[inline:], dst=self.peer, group=self.group)

    def receive(self) -> Any:
        import torch
        import torch.distributed as dist

        frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
        dist.recv(frame, src=self.peer, group=self.group)
        length = int.from_bytes(frame[:_LENGTH_BYTES].numpy().tobytes(), "little")
        inline = min(length, _INLINE_BYTES)
        payload = frame[_LENGTH_BYTES:_LENGTH_BYTES + inline].numpy().tobytes()
        if length > inline:
            rest = torch.empty(length - inline, dtype=torch.uint8)
            dist.recv(rest, src=self.peer, group=self.group)
            payload += rest.numpy().tobytes()
        return pickle.loads(payload)
