"""The one way snapshot bytes move between ranks: frames broadcast over a process group.

A frame is a small JSON header and a payload (a serialised snapshot). `ProcessGroupTransport`
sends one from a source rank to every other rank of a process group:

    1. the source broadcasts the two sizes (header bytes, payload bytes) as int64;
    2. every receiver checks them against its `FrameLimits`, and all ranks all-gather their
       verdicts; if no receiver accepts, the frame ends here;
    3. the source broadcasts the header, then the payload in chunks of CHUNK_BYTES. A receiver
       that refused takes part with one scratch chunk and keeps nothing, so that one rank with
       too little room never stops the others, and never allocates more than a chunk.

Two users, one implementation:
- restore (`exchange.restore_agreement`): over the job's default group, the rank that holds the newest
  state serves it to every rank that lacks it;
- replication (`exchange.replication`): over a side group of rank 0 and its replica targets (its
  own gloo connections, so its transfers never interleave with DDP's collectives).

Security: there is no port of ours. The bytes ride torch.distributed's own connections between the
job's ranks, which torch opens through the job's rendezvous store; like torch.distributed itself
this trusts the network between the nodes (docs/snapshots.md, "Trust model"). Whatever arrives is
checked before use all the same: sizes against limits before any allocation, the header as
untrusted JSON (`parse_header`), the payload against the checksum its header announces (by the
caller), and the snapshot itself loads with weights_only=True.

The group stays usable after any refusal. Not guaranteed: a frame whose header turns out not to
parse is refused only after its bytes arrived (its sizes were within the limits).
"""

from __future__ import annotations

import mmap
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic_ddp.snapshot.files.strict_json import StrictJSONError, encode_object, parse_object

# A header is a few hundred bytes of JSON; anything much larger is not one of ours.
MAX_HEADER_BYTES = 64 * 1024
# Payload bytes per broadcast: bounds the transient device copy for large snapshots.
CHUNK_BYTES = 64 * 2**20


class FrameError(Exception):
    """A frame that is not acceptable: sizes over the limits, or a header that is not one of ours."""


class FrameRefused(FrameError):
    """This receiver refused the frame's sizes (or every receiver did): it kept none of its bytes.

    `others_accepted` tells whether some other receiver took the frame (its bytes were sent).
    """

    def __init__(self, message: str, others_accepted: bool):
        super().__init__(message)
        self.others_accepted = others_accepted


@dataclass(frozen=True)
class FrameLimits:
    """The largest frame a receiver accepts."""

    max_payload_bytes: int
    # The same on every rank (a refused header must be refused by all: it is never sent then).
    max_header_bytes: int = MAX_HEADER_BYTES

    def check(self, header_bytes: int, payload_bytes: int) -> None:
        """Raise FrameError unless both announced sizes are within the limits."""
        if not 2 <= header_bytes <= self.max_header_bytes:
            raise FrameError(f"frame header of {header_bytes} bytes; expected 2 to {self.max_header_bytes}")
        if not 0 <= payload_bytes <= self.max_payload_bytes:
            raise FrameError(f"frame payload of {payload_bytes} bytes; expected at most {self.max_payload_bytes}")


@dataclass(frozen=True)
class Frame:
    header: dict[str, Any]
    payload: bytes | bytearray | mmap.mmap  # a received payload: anonymous memory, filled in place


def parse_header(raw: bytes) -> dict[str, Any]:
    """The JSON object in `raw`; FrameError for anything else (the contract of
    `snapshot.files.strict_json`: bad UTF-8, bad JSON, not an object, non-finite numbers, nesting
    too deep)."""
    try:
        return parse_object(raw)
    except StrictJSONError as exc:
        raise FrameError(f"frame header is {exc}") from exc


class ProcessGroupTransport:
    """Frames between the ranks of one process group, as broadcasts (see the module docstring).

    `group` None is the default group. `device` is where the group's tensors live (CUDA for NCCL).
    Every rank of the group calls `send` (the source) or `receive` (the others) for every frame,
    in the same order: a frame is a sequence of collectives. With `deadline`, each of them must
    complete within it (`Work.wait(timeout)`), else TimeoutError; the group is then unusable.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device = torch.device("cpu"),
                 deadline: timedelta | None = None, chunk_bytes: int = CHUNK_BYTES):
        self.group = group
        self.device = device
        self.deadline = deadline
        self.chunk_bytes = chunk_bytes

    def send(self, source_rank: int, header: dict[str, Any], payload: bytes | memoryview) -> list[bool]:
        """Broadcast one frame from this rank (`source_rank`, its global rank) to the group.

        Returns which ranks of the group accepted it, by group rank (this one included).
        """
        raw_header = encode_object(header)
        sizes = torch.tensor([len(raw_header), len(payload)], dtype=torch.int64, device=self.device)
        self._broadcast(sizes, source_rank)
        accepted = self._vote(accepts=True)
        if sum(accepted) > 1:  # someone besides this rank takes it
            self._broadcast(self._to_tensor(raw_header), source_rank)
            view = memoryview(payload).cast("B")
            for start in range(0, len(view), self.chunk_bytes):
                self._broadcast(self._to_tensor(view[start:start + self.chunk_bytes]), source_rank)
        return accepted

    def receive(self, source_rank: int, limits: FrameLimits) -> Frame:
        """Take part in the broadcast of the next frame from `source_rank`; return it once checked.

        Raises FrameRefused when this rank's `limits` refused its sizes (its bytes went by unkept),
        FrameError when its bytes arrived but its header is not a JSON object.
        """
        sizes = torch.empty(2, dtype=torch.int64, device=self.device)
        self._broadcast(sizes, source_rank)
        header_bytes, payload_bytes = (int(value) for value in sizes.tolist())
        refusal: FrameError | None = None
        try:
            limits.check(header_bytes, payload_bytes)
        except FrameError as exc:
            refusal = exc
        accepted = self._vote(accepts=refusal is None)
        if sum(accepted) <= 1:  # only the source: nothing follows
            raise FrameRefused(str(refusal or "every receiver refused the frame"), others_accepted=False)
        if refusal is not None:
            self._let_pass(header_bytes, payload_bytes, source_rank)
            raise FrameRefused(str(refusal), others_accepted=True) from refusal
        raw_header = bytearray(header_bytes)
        self._receive_into(raw_header, source_rank)
        # Received in place, chunk by chunk, into anonymous memory whose pages the broadcasts fill
        # (a bytearray is zeroed, and bytes() copied, under the GIL: 0.5-2.6 s per GB measured,
        # starving the peer watchdog's heartbeat).
        payload = mmap.mmap(-1, payload_bytes) if payload_bytes else bytearray()
        view = memoryview(payload)
        for start in range(0, payload_bytes, self.chunk_bytes):
            self._receive_into(view[start:start + self.chunk_bytes], source_rank)
        # Parsed only once every byte of the frame has arrived: the group stays in step either way.
        return Frame(parse_header(bytes(raw_header)), payload)

    def _let_pass(self, header_bytes: int, payload_bytes: int, source_rank: int) -> None:
        """Take part in a refused frame's broadcasts without keeping its bytes (one scratch chunk)."""
        scratch = torch.empty(min(self.chunk_bytes, max(header_bytes, payload_bytes, 1)), dtype=torch.uint8,
                              device=self.device)
        self._broadcast(scratch[:header_bytes], source_rank)
        for start in range(0, payload_bytes, self.chunk_bytes):
            self._broadcast(scratch[:min(self.chunk_bytes, payload_bytes - start)], source_rank)

    def _vote(self, accepts: bool) -> list[bool]:
        """Every rank's verdict on the frame's sizes, by group rank (a collective)."""
        size = dist.get_world_size(self.group)
        mine = torch.tensor([1 if accepts else 0], dtype=torch.int64, device=self.device)
        verdicts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(size)]
        self._wait(dist.all_gather(verdicts, mine, group=self.group, async_op=True))
        return [bool(verdict.item()) for verdict in verdicts]

    def _to_tensor(self, data: bytes | memoryview) -> torch.Tensor:
        """The bytes of `data` as a tensor on the group's device; on the CPU not copied (the source
        of a broadcast only reads it, so a read-only buffer is fine)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*non-writable.*")
            return torch.frombuffer(data, dtype=torch.uint8).to(self.device)

    def _receive_into(self, target: bytearray | memoryview, source_rank: int) -> None:
        landing = torch.frombuffer(target, dtype=torch.uint8)
        if self.device.type == "cpu":
            self._broadcast(landing, source_rank)
            return
        buffer = torch.empty(len(landing), dtype=torch.uint8, device=self.device)
        self._broadcast(buffer, source_rank)
        landing.copy_(buffer.cpu())

    def _broadcast(self, tensor: torch.Tensor, source_rank: int) -> None:
        self._wait(dist.broadcast(tensor, src=source_rank, group=self.group, async_op=True))

    def _wait(self, work: dist.Work) -> None:
        if self.deadline is None:
            work.wait()
        elif not work.wait(timeout=self.deadline):
            raise TimeoutError(f"a snapshot transfer did not complete within {self.deadline.total_seconds():g} s")
