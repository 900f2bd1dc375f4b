"""One file of a sharded step, from the node that holds it to the nodes that lack it.

The file rides the snapshot transport (`exchange.transport`) as one frame: a header
`{"kind": "sharded-file", "global_step": S, "name": N, "size": B, "checksum": C}` and the file's
bytes (read through a read-only map, never copied on the sender). Every rank of the group takes
part in every frame; only the ranks asked to keep the file accept its sizes, up to their free disk
space (a full disk refuses the frame before a byte is sent, without stopping the others); the others
let it pass. A receiver checks the header against the step's manifest (the same name, size and
checksum), the bytes against the checksum, and writes the file atomically (a temporary name, fsync,
rename, fsync of the directory) into the directory it was given. Then every rank reports one verdict
code (one all-gather, bounded like every collective of the transfer): the sender learns who keeps
the file, and why not.

Not guaranteed: a frame refused for room costs the ranks that let it pass one scratch chunk each;
the receivers' verdicts are codes, the receiver's log holds the details.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from elastic_ddp.snapshot.exchange.transport import FrameError, FrameLimits, FrameRefused, ProcessGroupTransport
from elastic_ddp.snapshot.files.backends import LocalDirectoryStorage
from elastic_ddp.snapshot.files.checksum import matches

logger = logging.getLogger(__name__)

# Verdict codes, one per rank and frame.
NOT_ASKED, STORED, NO_ROOM, DAMAGED, WRITE_FAILED = 0, 1, 2, 3, 4
REASONS = {NO_ROOM: "refused: too little free disk space",
           DAMAGED: "refused: it arrived damaged (its size or checksum is not the manifest's)",
           WRITE_FAILED: "refused: it could not be written (see that node's log)"}
KIND = "sharded-file"


def free_bytes(directory: Path) -> int:
    """What the filesystem under `directory` can still take (0 when it cannot be asked)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


def send_file(transport: ProcessGroupTransport, rank: int, step: int, path: Path, entry: dict) -> None:
    """Broadcast the file at `path` (listed in the manifest as `entry`) from this rank (`rank`)."""
    header = {"kind": KIND, "global_step": step, "name": path.name, "size": entry["size"],
              "checksum": entry["checksum"]}
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size != entry["size"]:
            raise OSError(f"{path}: {size} bytes; the manifest says {entry['size']}")
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    transport.send(rank, header, memoryview(data))  # (the map is unmapped once the last view of it is gone)


def receive_file(transport: ProcessGroupTransport, source: int, step: int, manifest: dict[str, dict],
                 into: Path | None) -> int:
    """Take part in the next frame from `source`; keep it in `into` (None: not asked to). Returns
    this rank's verdict code."""
    limit = free_bytes(into) if into is not None else 0
    try:
        frame = transport.receive(source, FrameLimits(max_payload_bytes=limit))
    except FrameRefused as exc:
        if into is None:
            return NOT_ASKED
        logger.warning("refused a file of sharded step %d: %s", step, exc)
        return NO_ROOM
    except FrameError as exc:
        logger.warning("refused a file of sharded step %d: %s", step, exc)
        return DAMAGED if into is not None else NOT_ASKED
    if into is None:  # a frame of size 0 passes a limit of 0: not ours all the same
        return NOT_ASKED
    header, payload = frame.header, frame.payload
    name = header.get("name")
    entry = manifest.get(name) if isinstance(name, str) else None
    if (header.get("kind") != KIND or header.get("global_step") != step or entry is None
            or header.get("size") != entry["size"] or header.get("checksum") != entry["checksum"]
            or len(payload) != entry["size"] or not matches(memoryview(payload), entry["checksum"])):
        logger.warning("refused a file of sharded step %d from rank %d: %s (not the file its manifest lists, or "
                       "damaged on the way)", step, source, str(name)[:80])
        return DAMAGED
    try:
        write_atomically(into / name, payload)
    except OSError as exc:
        logger.warning("could not keep %s: %s", into / name, exc)
        return WRITE_FAILED
    return STORED


def write_atomically(path: Path, data: bytes | bytearray | mmap.mmap) -> None:
    """`data` at `path`, whole or not at all (`LocalDirectoryStorage.write_atomically`: a temporary
    name, fsync, rename, fsync of the directory), its directory made first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    LocalDirectoryStorage(path.parent).write_atomically(path.name, data)


def verdicts(group: dist.ProcessGroup | None, code: int, deadline: timedelta) -> list[int]:
    """Every rank's verdict code on the frame just sent, by group rank (a collective)."""
    size = dist.get_world_size(group)
    mine = torch.tensor([code], dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    if not work.wait(timeout=deadline):
        raise TimeoutError(f"the verdicts on a sharded file did not arrive within {deadline.total_seconds():g} s")
    return [int(value.item()) for value in gathered]
