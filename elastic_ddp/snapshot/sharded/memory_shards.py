"""Memory copies of a sharded state: each rank's part, and a copy of it on another node.

With `--sharding fsdp` no rank holds the whole state, so a rank's own memory copy is not enough: a
lost node takes its ranks' shards with it. Here, at each committed step (and right after a restore):

- on the training thread, inside the commit, every rank copies its part of the state into a reused
  buffer (`memory_checkpoint.PartWriter`: its shards of the model and optimizer as a DCP checkpoint
  in memory) and starts the step's exchange (`exchange`);
- on a thread of its own, while the next step computes, the part is checked for NaNs and
  infinities and hashed, and kept unless it holds one (a diverged state is never kept: the parts
  of the step before stay the newest); it is sent to its *buddy*, a rank on another node (ring.py:
  the same local rank on the next node), the part received from the rank before is checked and
  kept, and a barrier over every rank ends the exchange: every part is then in the memory of two
  nodes, so the loss of any one node leaves every part somewhere. On a single node the buddy is
  the next rank of the node (a lost worker is covered; the loss of the node itself is not, as in
  DDP mode), and rank 0 says so once.

The thread's collectives run over a gloo process group of their own (`dist.new_group`, created with
the ring at the first exchange, at the same step on every rank), so they never interleave with the
training group's; one exchange is in flight at a time: the next step's `wait` comes first. A step
*counts* on this rank once its exchange ended (`counted`; `uncounted` while it runs or after it
failed): the session reports it then (its `step` event, its audit line) and only then may a restore
take it (its rest is written with the part only if it counts). An error on the thread is raised on
the training thread by `wait` (PartExchangeError), or logged by `settle` as training stops.

Checksums (BLAKE3, snapshot/files/checksum.py): the tensors (index and data) are hashed once, when
the part is taken, and checked once, when the buddy receives them. The unsharded rest, added to a
rank's own part right after the commit, is held as a copy of its objects and serialised (with a
checksum of its own) only when the part is written: nothing of it is hashed or pickled per step.

What is kept: the parts (own and buddy's) of the newest step that counts here and whose parts every
rank took and exchanged whole (finite), plus those of the step being exchanged. A failure during
the exchange of step N leaves some buddies without step N, and then step N-1 is the newest one
whose parts are all present; once step N counts here (its rest added) and every rank's part of N
was exchanged (the barrier also says whether every part was finite), step N-1's parts are dropped:
if this rank survives, N is a counted state whose every part is on two nodes. So at most four parts
per rank exist at once (own and buddy's, two steps: nearly always, as an exchange runs during the
next step); the buffers of dropped parts are reused for the next step's (the part taken, the part
received) when their size fits, so that a step does not fault in fresh pages. The part is sent as
it was taken (no joined copy of its bytes).

When the worker stops early (`keep`, no collective: the group may be broken) every rank writes what
it holds into its node's memory directory (the run's private directory of snapshot/memory_copies.py),
one file per part: `shard-<step>-<incarnation>-<part>of<world>.bin` (a JSON header with the two
checksums, then the payload), written to a temporary name and renamed. The next
worker group gathers them (memory_restore.py).

Not guaranteed: a part whose two holders (its rank and its buddy) both die is lost, and the restart
falls back to the newest durable snapshot (the `restore` event says why). The step being exchanged
when training stops early counts only if its exchange ends within the caller's bound (`settle`).
The copies cost memory: four parts per rank (own and buddy's, two steps), and the exchange sends
each rank's part over the network at every step. A part dropped while `keep` writes it from another
thread (a peer silent) and then reused could be written torn: its checksum refuses it at the restore.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import queue
import re
import secrets
import struct
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.exchange.replication import SIDE_GROUP_TIMEOUT
from elastic_ddp.snapshot.files.checksum import new_hasher
from elastic_ddp.snapshot.files.errors import SnapshotError
from elastic_ddp.snapshot.files.strict_json import StrictJSONError, encode_object, parse_object
from elastic_ddp.snapshot.sharded.ring import node_of_each_rank, ring_partners, warn_if_not_spread

logger = logging.getLogger(__name__)

KEEP_STEPS = 2  # at most, see the module docstring
FILE_PATTERN = re.compile(r"^shard-(\d{9})-(\d{1,19})-(\d{1,6})of(\d{1,6})\.bin$")
MAX_HEADER_BYTES = 64 * 1024
LENGTH = struct.Struct("<q")
FORMAT = 2  # 2: raw chunks (memory_checkpoint.PartWriter), BLAKE3 of the tensors and of the rest apart


def checksum_of(*chunks: bytes | memoryview) -> str:
    """BLAKE3 of `chunks` one after the other (the GIL is released while it hashes)."""
    hasher = new_hasher()
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.hexdigest()


@dataclass(frozen=True)
class ShardCopy:
    """One rank's part of the state of one committed step."""

    step: int
    incarnation: int  # the incarnation that committed the step
    world_size: int  # of the group that committed it: its parts are 0 .. world_size - 1
    part: int  # the rank that wrote it
    index: bytes  # its DCP `.metadata`
    plain: bytes  # the unsharded rest, a format-2 snapshot with this rank's RNG
    data: bytes | memoryview  # its DCP data file (a view of the buffer it was taken or received in)
    checksum: str  # of index + data
    rest_checksum: str = ""  # of plain
    finite: bool = True  # False: its tensors hold a NaN or an infinity (sent, never kept)

    @property
    def key(self) -> tuple[int, int]:
        return self.step, self.incarnation

    @property
    def file_name(self) -> str:
        return f"shard-{self.step:09d}-{self.incarnation}-{self.part}of{self.world_size}.bin"

    def head(self) -> bytes:
        """Everything but the data: the length of the header, the header, the index and the rest."""
        header = encode_object({"format": FORMAT, "step": self.step, "incarnation": self.incarnation,
                                "world_size": self.world_size, "part": self.part, "index_bytes": len(self.index),
                                "plain_bytes": len(self.plain), "checksum": self.checksum,
                                "rest_checksum": self.rest_checksum, "finite": self.finite})
        return b"".join((LENGTH.pack(len(header)), header, self.index, self.plain))

    def to_bytes(self) -> bytes:
        return b"".join((self.head(), self.data))

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray | memoryview, source: str) -> ShardCopy:
        """The copy in `raw`; SnapshotError when it is torn, damaged or not one (untrusted input)."""
        return cls.from_head_and_data(raw, None, source)

    @classmethod
    def from_head_and_data(cls, raw: bytes | bytearray | memoryview, data: memoryview | None,
                           source: str) -> ShardCopy:
        """The copy whose `head()` is `raw` and whose data is `data` (None: the data follows the head
        in `raw`, as `to_bytes` lays it out); SnapshotError when it is torn, damaged or not one."""
        raw = memoryview(raw)
        try:
            (header_bytes,) = LENGTH.unpack_from(raw, 0)
            if not 2 <= header_bytes <= min(MAX_HEADER_BYTES, len(raw) - LENGTH.size):
                raise SnapshotError(f"{source}: a header of {header_bytes} bytes")
            header = parse_object(bytes(raw[LENGTH.size:LENGTH.size + header_bytes]))
            fields = [header[name] for name in ("step", "incarnation", "world_size", "part", "index_bytes",
                                                "plain_bytes")]
            if not all(isinstance(value, int) and value >= 0 for value in fields):
                raise SnapshotError(f"{source}: a header with a field that is not a count")
            step, incarnation, world_size, part, index_bytes, plain_bytes = fields
            if (header["format"] != FORMAT or not isinstance(header["checksum"], str) or part >= world_size
                    or not isinstance(header["rest_checksum"], str) or not isinstance(header["finite"], bool)):
                raise SnapshotError(f"{source}: an inconsistent header (or one of another format than {FORMAT})")
        except (struct.error, StrictJSONError, KeyError) as exc:
            raise SnapshotError(f"{source}: not a shard copy ({exc})") from exc
        body = raw[LENGTH.size + header_bytes:]
        if index_bytes + plain_bytes > len(body) or (data is not None and index_bytes + plain_bytes != len(body)):
            raise SnapshotError(f"{source}: torn (shorter than its header says)")
        index, plain = body[:index_bytes], body[index_bytes:index_bytes + plain_bytes]
        data = body[index_bytes + plain_bytes:] if data is None else data
        if checksum_of(index, data) != header["checksum"]:
            raise SnapshotError(f"{source}: torn or damaged (the checksum of its tensors does not match)")
        if plain_bytes and checksum_of(plain) != header["rest_checksum"]:
            raise SnapshotError(f"{source}: damaged (the checksum of its unsharded rest does not match)")
        return cls(step, incarnation, world_size, part, bytes(index), bytes(plain), data, header["checksum"],
                   header["rest_checksum"], header["finite"])


def make_copy(step: int, incarnation: int, context: DistributedContext, index: bytes, plain: bytes,
              data: bytes | memoryview, finite: bool = True) -> ShardCopy:
    return ShardCopy(step, incarnation, context.world_size, context.rank, index, plain, data,
                     checksum_of(index, data), checksum_of(plain) if plain else "", finite)


def exchange_part(head: bytes, data: bytes | memoryview, send_to: int, receive_from: int,
                  group: dist.ProcessGroup | None, spare: memoryview | None = None) -> tuple[memoryview, memoryview]:
    """Send a part to `send_to` and receive `receive_from`'s, point to point over `group` (gloo, on
    the CPU; None: the default group).

    The part goes as it was taken, `head` (`ShardCopy.head`) then `data`: two frames after their
    sizes, with no joined copy of its bytes. The data received lands in `spare` when that has its
    size, else in a new buffer. Returns the (head, data) received: only bytes, which the caller
    checks (`ShardCopy.from_head_and_data`: header, sizes, checksum). SnapshotError when the sender
    announces sizes far beyond this rank's part."""
    sizes_out = torch.tensor([len(head), len(data)], dtype=torch.int64)
    sizes_in = torch.zeros(2, dtype=torch.int64)
    _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, sizes_out, send_to, group),
                                  dist.P2POp(dist.irecv, sizes_in, receive_from, group)]))
    head_size, data_size = (int(size) for size in sizes_in.tolist())
    if not (0 < head_size <= 4 * len(head) + 2**26 and 0 <= data_size <= 4 * len(data) + 2**26):
        raise SnapshotError(f"rank {receive_from} announced a part of {head_size} + {data_size} bytes; this rank's is "
                            f"{len(head)} + {len(data)}")
    head_in = torch.empty(head_size, dtype=torch.uint8)
    reuse = spare is not None and spare.nbytes == data_size and data_size > 0
    data_in = torch.frombuffer(spare, dtype=torch.uint8) if reuse else torch.empty(data_size, dtype=torch.uint8)
    operations = []
    for tag, out, into in ((1, _as_tensor(head), head_in), (2, _as_tensor(data), data_in)):
        # Both frames in one round, each on a tag of its own: they cannot be matched the wrong way round.
        operations += [dist.P2POp(dist.isend, out, send_to, group, tag)] if out.numel() else []
        operations += [dist.P2POp(dist.irecv, into, receive_from, group, tag)] if into.numel() else []
    _wait(dist.batch_isend_irecv(operations))
    # `spare` itself, not a view made anew: views of views would chain step after step
    return memoryview(head_in.numpy()), spare if reuse else memoryview(data_in.numpy())


def _as_tensor(raw: bytes | memoryview) -> torch.Tensor:
    if not len(raw):
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # "the given buffer is not writable": it is only read (sent)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(raw, dtype=torch.uint8)


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def every_rank(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether `flag` holds on every rank of `group` (gloo; collective: an all-reduce, a barrier too)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


class PartExchangeError(RuntimeError):
    """The exchange of a step's parts failed on its thread; raised on the training thread."""


class _Exchange:
    """One step's exchange, run by the exchanges' thread; `error` holds what it raised."""

    def __init__(self, step: int, work: Callable[[], None]):
        self.step, self.work = step, work
        self.error: Exception | None = None
        self.ended = threading.Event()

    def run(self) -> None:
        try:
            self.work()
        except Exception as exc:  # noqa: BLE001 - handed to the training thread (`ShardMemory.wait`)
            self.error = exc
        finally:
            self.ended.set()


def _run_exchanges(jobs: queue.SimpleQueue[_Exchange | None]) -> None:
    """The exchanges' thread: one job after the other, until None."""
    while (job := jobs.get()) is not None:
        job.run()


class ShardMemory:
    """The parts this rank holds in memory, and their copies in its node's memory directory."""

    def __init__(self, context: DistributedContext, directory: Path | None):
        self.context = context
        self.directory = directory  # None: the memory directory could not be used (keep writes nothing)
        self.own: list[ShardCopy] = []
        self.held: list[ShardCopy] = []  # received from the rank before this one in the ring
        self.partners: tuple[int, int] | None = None  # (buddy, whose buddy this rank is): ring.py
        self.damaged: list[tuple[int, int, int, str]] = []  # (step, incarnation, part, why): `stored` removed them
        self.counted: int | None = None  # the newest step whose exchange ended on this rank
        self.uncounted: int | None = None  # a step whose exchange began and has not ended whole
        self._rests: dict[int, Callable[[], bytes]] = {}  # step -> its own part's rest, made when written
        self._group: dist.ProcessGroup | None = None  # the exchanges' own (gloo), set up with the ring
        self._ring_known = False
        self._complete: tuple[int, int] | None = None  # the newest step every rank took and exchanged whole
        self._spare: dict[str, memoryview | None] = {"own": None, "held": None}  # buffers of dropped parts
        self._in_flight: _Exchange | None = None
        self._jobs: queue.SimpleQueue[_Exchange | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # runs the exchanges, started with the first
        self._lock = threading.Lock()  # the lists and spares: the exchange's thread, `keep` (any thread)

    def exchange(self, step: int, incarnation: int, index: bytes, data: memoryview,
                 check: Callable[[], bool] | None = None) -> None:
        """Start the exchange of this rank's part of `step` (the tensors' `index` and `data`, a buffer
        nothing changes any more), on a thread of its own: the part is hashed and kept, sent to the
        buddy, the partner's part received, checked and kept, then a barrier over every rank says
        whether every part was finite. Once the barrier returns on any rank, every part of the step is
        on two ranks. Call it on the training thread of every rank at the same step, after `wait`
        (one exchange at a time); the first call sets up the ring and the exchanges' process group
        (collectives on the default group). `check()` runs first on the thread: it waits until
        `data` is filled (a device copy in flight) and says whether the part is finite (None: it
        is). A part that is not finite is sent all the same (the exchange is symmetric) and kept by
        neither side."""
        assert self._in_flight is None, "one exchange at a time: wait() first"
        if not self._ring_known:
            nodes = node_of_each_rank(self.context)
            self.partners, self._ring_known = ring_partners(self.context.rank, nodes), True
            if self.partners is not None and self.context.in_process_group:
                self._group = dist.new_group(list(range(self.context.world_size)), backend="gloo",
                                             timeout=SIDE_GROUP_TIMEOUT)
            if self.context.is_main:
                warn_if_not_spread(nodes)
        with self._lock:
            spare = self._take_spare("held")
        self.uncounted = step
        if self._thread is None:  # a daemon: a frozen peer may hold an exchange for ever
            self._thread = threading.Thread(target=_run_exchanges, args=(self._jobs,), name="shard-exchanges",
                                            daemon=True)
            self._thread.start()
        self._in_flight = _Exchange(step, functools.partial(self._exchange, step, incarnation, index, data, check,
                                                            spare))
        self._jobs.put(self._in_flight)

    def _exchange(self, step: int, incarnation: int, index: bytes, data: memoryview,
                  check: Callable[[], bool] | None, spare: memoryview | None) -> None:
        """The exchange's thread (see `exchange`); collectives over the exchanges' own group only."""
        finite = check() if check is not None else True
        copy = make_copy(step, incarnation, self.context, index, b"", data, finite)
        with self._lock:
            if copy.finite:
                self.own = self._kept(self.own, copy, "own")
            else:
                self._retire(copy, "own")
        if self.partners is None or self._group is None:
            self._complete = copy.key if copy.finite else None
            return
        head, received = exchange_part(copy.head(), copy.data, *self.partners, self._group, spare)
        held = ShardCopy.from_head_and_data(head, received, f"the part sent by rank {self.partners[1]}")
        with self._lock:
            if held.finite:
                self.held = self._kept(self.held, held, "held")
            else:
                self._retire(held, "held")
        # The barrier: once it returns on any rank, every part of the step is on two ranks.
        self._complete = copy.key if every_rank(copy.finite and held.finite, self._group) else None

    def wait(self) -> None:
        """Wait for the exchange in flight (training thread): its step then counts on this rank
        (`counted`), and once its rest is added the parts of the steps before are dropped.
        PartExchangeError when it failed."""
        exchange = self._in_flight
        if exchange is None:
            return
        exchange.ended.wait()
        self._ended(exchange)
        if exchange.error is not None:
            raise PartExchangeError(f"the exchange of step {exchange.step}'s memory parts with rank(s) "
                                    f"{self.partners} failed: {exchange.error}") from exchange.error

    def settle(self, timeout_s: float) -> None:
        """Wait at most `timeout_s` for the exchange in flight, from any thread, as training stops:
        an exchange that ended whole counts; one that failed, or still runs (a peer silent), is
        logged and its step does not count. Never raises."""
        exchange = self._in_flight
        if exchange is None:
            return
        if not exchange.ended.wait(timeout_s):
            logger.warning("the exchange of step %d's memory parts has not ended within %g s: step %d does not "
                           "count here", exchange.step, timeout_s, exchange.step)
            return
        self._ended(exchange)
        if exchange.error is not None:
            logger.error("the exchange of step %d's memory parts failed (step %d does not count here): %s",
                         exchange.step, exchange.step, exchange.error)

    def _ended(self, exchange: _Exchange) -> None:
        with self._lock:
            if self._in_flight is not exchange:
                return  # another thread took it
            self._in_flight = None
            if exchange.error is None:
                self.counted, self.uncounted = exchange.step, None
        if exchange.error is None:
            self._drop_older_than_counted()

    def stop(self) -> None:
        """The exchanges' thread ends once the exchange in flight, if any, has (call `settle` first)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    def take_spare(self) -> memoryview | None:
        """A buffer of a dropped own part, for the next part taken (PartWriter.save's `into`)."""
        with self._lock:
            return self._take_spare("own")

    def _take_spare(self, kind: str) -> memoryview | None:
        spare, self._spare[kind] = self._spare[kind], None
        return spare

    def _kept(self, copies: list[ShardCopy], copy: ShardCopy, kind: str) -> list[ShardCopy]:
        kept = [*copies, copy]
        for dropped in kept[:-KEEP_STEPS]:
            self._retire(dropped, kind)
        return kept[-KEEP_STEPS:]

    def _retire(self, copy: ShardCopy, kind: str) -> None:
        """`copy` is no longer held: its buffer may take the next part of `kind`."""
        if isinstance(copy.data, memoryview) and not copy.data.readonly and copy.data.nbytes:
            self._spare[kind] = copy.data

    def _drop_older_than_counted(self) -> None:
        """The step counted here, once its rest is added, is whole on two nodes: the parts of the
        steps before are dropped (the module docstring says why that is enough)."""
        with self._lock:
            if not self.own or self.own[-1].key != self._complete or self.own[-1].step != self.counted \
                    or self.counted not in self._rests:
                return
            key = self.own[-1].key
            for kind, copies in (("own", self.own), ("held", self.held)):
                for copy in copies:
                    if copy.key != key:
                        self._retire(copy, kind)
            self.own = [copy for copy in self.own if copy.key == key]
            self.held = [copy for copy in self.held if copy.key == key]
            self._rests = {step: make for step, make in self._rests.items() if step >= key[0]}

    def add_rest(self, step: int, rest: Callable[[], bytes]) -> None:
        """Add the unsharded rest to this rank's own part of `step` (right after the commit of the
        step: it is taken then, and counts once the step's exchange ended). `rest()` makes its bytes,
        only when the part is written (`keep`): it must hold a copy of the state, not refer to the
        live one."""
        with self._lock:
            held_steps = {copy.step for copy in self.own}
            self._rests = {**{known: make for known, make in self._rests.items() if known in held_steps}, step: rest}
        self._drop_older_than_counted()

    def _add_rests(self) -> None:
        """The rests `add_rest` deferred, made into bytes (when the parts are written), for the
        steps that count: a part without its rest is never restored alone."""
        for position, copy in enumerate(self.own):
            make = self._rests.get(copy.step)
            if make is not None and not copy.plain and self.counted is not None and copy.step <= self.counted:
                plain = make()
                self.own[position] = dataclasses.replace(copy, plain=plain, rest_checksum=checksum_of(plain))

    def keep(self) -> tuple[int, int]:
        """Write the parts held into the node's memory directory (no collective); (files written,
        bytes). Never raises an OSError (logged)."""
        if self.directory is None:
            return 0, 0
        with self._lock:
            self._add_rests()
            copies = [*self.own, *self.held]
        written = size = 0
        for copy in copies:
            path = self.directory / copy.file_name
            if path.exists():
                continue  # a sibling rank of this node wrote the same part
            raw = copy.to_bytes()
            temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
            try:
                with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
                    handle.write(raw)
                os.replace(temporary, path)
            except OSError as exc:
                temporary.unlink(missing_ok=True)
                logger.error("part %d of step %d not kept in memory: %s", copy.part, copy.step, exc)
                continue
            written, size = written + 1, size + len(raw)
        return written, size

    def stored(self) -> list[ShardCopy]:
        """The whole copies in the node's memory directory (a damaged one is removed, logged and
        listed in `damaged`)."""
        self.damaged = []
        if self.directory is None or not self.directory.is_dir():
            return []
        found = []
        for name in sorted(os.listdir(self.directory)):
            match = FILE_PATTERN.match(name)
            if not match:
                continue
            path = self.directory / name
            try:
                copy = ShardCopy.from_bytes(path.read_bytes(), str(path))
                if copy.file_name != name:
                    raise SnapshotError(f"{path}: holds part {copy.part} of step {copy.step}, not what its name says")
            except FileNotFoundError:
                continue
            except (OSError, SnapshotError) as exc:
                logger.warning("memory copy of a shard refused: %s", exc)
                path.unlink(missing_ok=True)
                self.damaged.append((int(match.group(1)), int(match.group(2)), int(match.group(3)),
                                     str(exc).removeprefix(f"{path}: ")))
                continue
            found.append(copy)
        return found

    def remove_all_but(self, keep: tuple[int, int] | None) -> None:
        """Remove the node's files of every (step, incarnation) but `keep` (the one just restored:
        newer ones are states that never counted, or were refused)."""
        if self.directory is None or not self.directory.is_dir():
            return
        for name in os.listdir(self.directory):
            match = FILE_PATTERN.match(name)
            if match and (int(match.group(1)), int(match.group(2))) != keep:
                (self.directory / name).unlink(missing_ok=True)

    def forget(self) -> None:
        """The run finished: remove every file (local rank 0) and what this rank holds."""
        with self._lock:
            self.own, self.held, self._spare = [], [], {"own": None, "held": None}
        if self.directory is not None and self.context.local_rank == 0:
            self.remove_all_but(None)
