"""The peer watchdog's verdict, handed from a worker to its torchrun agent through a small file.

A worker whose peer watchdog (elastic_ddp/runtime/watchdog.py) found peers silent writes, just
before it ends with `SILENT_PEER_EXIT_CODE`, which nodes they were: their `GROUP_RANK`s, the ranks
of their nodes in the round that started this worker. Its agent's keyed rendezvous reads the file
when it enters the next round (elastic_ddp/agent/rendezvous/keyed_silence.py) and takes it as one of
two pieces of evidence that a member is not alive; the other is its own probe of that node's beacon.

Both sides find the file without talking to each other: its name is made from what the worker's
environment holds and the agent's handler made itself when the round formed, the run id, rank 0's
store address and port (`MASTER_ADDR`, `MASTER_PORT`: a new port each round) and the node's rank
(`GROUP_RANK`). So a verdict is about one round of one node, and a later round never reads it.
The directory is private to the user (0700) under the temporary directory; one that belongs to
someone else, or that others may write in, is not used.

The file is untrusted input for the agent: read at most `MAX_VERDICT_BYTES`, JSON with one list of
node ranks, anything else ignored (no verdict). A forged verdict cannot remove a live node on its
own: the beacon probe must also go unanswered.

    path = verdict_path("run", "10.0.0.1", 29511, group_rank=2)
    write_verdict(path, {1})        # the worker: node 1 of this round is silent
    take_verdict(path)              # the agent: {1}, and the file is gone

Not guaranteed: that every file is read. A worker cannot tell whether its agent reads verdicts;
under a rendezvous that does not (torch's own `c10d`, `algorithm=dynamic`), or when the agent ends
by a signal before its next round, the file (a few dozen bytes) stays in the directory.

The bottom layer of the package: it imports neither torch nor anything of elastic_ddp, so the agent
(which never imports the worker side) and the worker both use it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

# A verdict names a few node ranks; 64 KiB holds over 8000 of them.
MAX_VERDICT_BYTES = 64 * 1024
_DIRECTORY_NAME = "elastic_ddp-verdicts"


def verdict_directory() -> Path:
    """Where this user's verdict files live (the same for a worker and its agent)."""
    return Path(tempfile.gettempdir()) / f"{_DIRECTORY_NAME}-{os.getuid()}"


def verdict_path(run_id: str, master_addr: str, master_port: int, group_rank: int,
                 directory: Path | None = None) -> Path:
    """The verdict file of node `group_rank` in the round whose workers' store is at
    `master_addr:master_port`. The name is a digest: no character of a run id reaches the path."""
    key = json.dumps([run_id, master_addr, int(master_port), int(group_rank)]).encode()
    return (directory or verdict_directory()) / f"{hashlib.sha256(key).hexdigest()[:32]}.json"


def worker_verdict_path(environment: Mapping[str, str] = os.environ) -> Path | None:
    """This worker's verdict file, from what torchrun put in its environment; None outside torchrun."""
    try:
        return verdict_path(environment["TORCHELASTIC_RUN_ID"], environment["MASTER_ADDR"],
                            int(environment["MASTER_PORT"]), int(environment["GROUP_RANK"]))
    except (KeyError, ValueError):
        return None


def write_verdict(path: Path, silent_node_ranks: Iterable[int]) -> None:
    """Write the verdict whole (a rename), or not at all: an error propagates to the caller."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _ours(path.parent):
        raise PermissionError(f"{path.parent} belongs to another user: no verdict written")
    text = json.dumps({"silent_node_ranks": sorted({int(rank) for rank in silent_node_ranks})})
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".verdict-")
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def take_verdict(path: Path) -> set[int]:
    """The node ranks the verdict at `path` names, and the file removed; an empty set when there is
    none, or when it is not a valid verdict (longer than `MAX_VERDICT_BYTES`, not our JSON)."""
    if not _ours(path.parent):
        return set()
    try:
        with open(path, "rb") as file:
            content = file.read(MAX_VERDICT_BYTES + 1)
        path.unlink(missing_ok=True)
    except OSError:
        return set()
    if len(content) > MAX_VERDICT_BYTES:
        return set()
    try:
        ranks = json.loads(content).get("silent_node_ranks")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return set()
    if not isinstance(ranks, list) or not all(_is_rank(rank) for rank in ranks):
        return set()
    return set(ranks)


def _ours(directory: Path) -> bool:
    """Whether `directory` is this user's and nobody else may write in it (a shared /tmp)."""
    try:
        status = directory.lstat()
    except OSError:
        return False
    return status.st_uid == os.getuid() and not status.st_mode & 0o022


def _is_rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31
