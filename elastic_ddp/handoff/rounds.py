"""The files through which a node's torchrun agent and its workers hand over a rendezvous round in process.

When a node is lost, the surviving workers re-form their process group in their own processes
instead of being restarted by torchrun (docs/design/in-process-re-form.md). The round is run by the node's
agent (our rendezvous handler, in torchrun's process); its workers only learn the result. This
module is the whole contract between the two sides, which otherwise import nothing of each other:
torch-free, standard library only.

One private directory per agent, made by the agent (`open_handoff`), removed by it (`close_handoff`):

    TMPDIR/elastic_ddp-agent-<uid>/handoff-<agent pid>/
        capable-<local rank>.json   worker -> agent: {"local_rank": 1, "local_world_size": 2, "pid": 4243}
                                    this worker can re-form in its own process (`declare_capable`)
        request-<local rank>.json   worker -> agent: {"broken_round": 3, "reason": "connection reset"}
                                    my process group of round 3 broke; please run a new round (`request_reform`)
        round.json                  agent -> workers (`publish_round`):
        {"round": 4, "group_rank": 0, "group_world_size": 2, "master_addr": "10.0.0.1",
         "master_port": 29517, "in_process": true, "joined": 0, "reason": ""}

A worker finds the directory from its agent's pid (`runtime.distributed.agent_pid()`), so nothing
is passed in the environment. Local ranks run from 0 to `MAX_LOCAL_WORLD_SIZE - 1`. Every file is
written whole: a temporary file in the same directory, renamed over the name (`os.replace`), so a
reader sees the old content or the new one, never half.

Why files and not a socket (as `verdicts` uses): an abstract Unix socket is reachable from every
process, every container, that shares the network namespace, so a forged re-form request could pause
the job at will. A 0700 directory of this user is not. Both levels of directory are checked on
every write and read: a directory of this user, not a link, that no one else may enter
(`rendezvous_figures.make_private_directory`'s rule). Only the agent creates the directory; a worker
whose agent has none (torch's own rendezvous, in-process re-forming switched off) gets
FileNotFoundError and takes the restart path.

File contents are still untrusted input: a reader opens without following links, trusts a file only
if it is a regular file this user owns, refuses one over `MAX_FILE_BYTES`, and checks the schema
strictly: exactly the fields above, no more (both sides run the same installed elastic_ddp); ints
are ints, not bools; ranks and ports in range; a reason of one line of at most `MAX_REASON_CHARS`.
Anything else is no file: the reader returns None or skips the entry, and never raises on garbage.
Files it does not recognise (other names, the writers' temporary files) are ignored.

Not guaranteed:
- A capable worker counts as alive while its pid runs (`os.kill(pid, 0)`). A pid reused by another
  process of this user, or a worker that has exited but is not yet reaped by torchrun (a zombie),
  still counts until its file is withdrawn or the agent's next `open_handoff` removes it.
- `clear_requests` removes every request, also one a worker wrote after the agent's last
  `reform_requests`: the agent clears only once the round that answers them is published.
- Nothing is flushed to disk: the files live as long as the machine's processes do, and a machine
  that crashes takes its agent and workers with it.
- Another process of this user can write here too. The directory keeps out other users and other
  containers, not this user's own processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from elastic_ddp.handoff.rendezvous_figures import DIRECTORY_PREFIX, make_private_directory

# Our files hold a few short fields (round.json is about 150 bytes): a larger one is not ours.
MAX_FILE_BYTES = 4 * 1024
MAX_REASON_CHARS = 500
# Bound on a node's local ranks, so that a file name cannot name any integer; no node runs this many workers.
MAX_LOCAL_WORLD_SIZE = 4096
# A hostname is at most 253 characters, an IPv6 address with its zone far less.
MAX_ADDRESS_CHARS = 255
# Above Linux's largest pid_max (2**22); keeps os.kill's argument within a C int.
MAX_PID = 2**31 - 1
# Counts (rounds, nodes) bounded as a JSON integer another side may store in an int64.
MAX_COUNT = 2**63 - 1

# What the agent exports to its workers: "1" when its handler re-forms rounds in process for them, else "0".
IN_PROCESS_ENV = "ELASTIC_DDP_IN_PROCESS"
HANDOFF_PREFIX = "handoff-"
ROUND_FILE = "round.json"
CAPABLE_PREFIX = "capable-"
REQUEST_PREFIX = "request-"
# A local rank in a file name: decimal, no sign, no leading zero (so that one rank has one name).
_RANKED_FILE = re.compile(r"(capable|request)-(0|[1-9][0-9]{0,3})\.json")


@dataclass(frozen=True)
class RoundAnnouncement:
    """A rendezvous round as the agent tells its workers.

    The fields are checked when it is made: ValueError (TypeError for a value of the wrong type,
    bool for int included) names the field, the value and what is allowed. `reason` is kept to its
    first line and `MAX_REASON_CHARS`, so that any exception's text may be passed.
    """

    round: int  # the rendezvous round number (>= 0)
    group_rank: int  # this node's rank in the round (>= 0, < group_world_size)
    group_world_size: int  # nodes in the round (>= 1)
    master_addr: str  # where the round's rank 0 worker hosts the workers' store (non-empty, <= 255 chars)
    master_port: int  # 1..65535
    # True: the workers re-form in their own processes; False: torchrun started (or is about to
    # restart) the workers for this round.
    in_process: bool
    reason: str = ""  # one line: why not in process ("" when in process); <= 500 chars
    # Nodes new to the group in this round (>= 0, < group_world_size): with newcomers the survivors
    # restore as after a restart (theirs is the newest state, which the newcomers receive).
    joined: int = 0
    # In process (required then, else None): the global rank of this node's local rank 0, and the
    # workers in the round, as torch's rank assignment gives them (nodes in group-rank order, each
    # with its own number of workers: they need not be equal).
    first_rank: int | None = None
    world_size: int | None = None

    def __post_init__(self) -> None:
        _check_int("round", self.round, 0, MAX_COUNT)
        _check_int("group_world_size", self.group_world_size, 1, MAX_COUNT)
        _check_int("group_rank", self.group_rank, 0, self.group_world_size - 1)
        _check_int("master_port", self.master_port, 1, 65535)
        _check_int("joined", self.joined, 0, self.group_world_size - 1)
        if self.in_process or self.first_rank is not None or self.world_size is not None:
            _check_int("world_size", self.world_size, self.group_world_size, MAX_COUNT)
            _check_int("first_rank", self.first_rank, self.group_rank, self.world_size - 1)
        if not isinstance(self.master_addr, str):
            raise TypeError(f"master_addr {self.master_addr!r}: a string is wanted")
        if not _is_address(self.master_addr):
            raise ValueError(f"master_addr {self.master_addr!r}: a host name or address is wanted "
                             f"(1 to {MAX_ADDRESS_CHARS} printable characters, no spaces)")
        if not isinstance(self.in_process, bool):
            raise TypeError(f"in_process {self.in_process!r}: True or False is wanted")
        object.__setattr__(self, "reason", _checked_reason(self.reason))


@dataclass(frozen=True)
class ReformRequest:
    """A worker's request for a new round: its process group of `broken_round` broke.

    Checked when made as `RoundAnnouncement` is; `reason` is kept to its first line and `MAX_REASON_CHARS`.
    """

    broken_round: int  # the round whose process group broke in this worker (>= 0)
    reason: str  # one line (<= 500 chars)

    def __post_init__(self) -> None:
        _check_int("broken_round", self.broken_round, 0, MAX_COUNT)
        object.__setattr__(self, "reason", _checked_reason(self.reason))


def handoff_directory(agent_pid: int) -> Path:
    """Where the agent `agent_pid` (of this user) and its workers hand over rounds."""
    return Path(tempfile.gettempdir()) / f"{DIRECTORY_PREFIX}{os.getuid()}" / f"{HANDOFF_PREFIX}{agent_pid}"


# --- the agent's side ---


def open_handoff(agent_pid: int) -> Path:
    """Make the agent's directory (both levels private, checked) and empty it: the requests, capable
    marks and round of workers that torchrun has since stopped are gone. Call it before the workers
    start. Returns the directory; PermissionError for a directory that is not private, another
    OSError if a file in it cannot be removed."""
    directory = handoff_directory(agent_pid)
    try:
        _make_private_directories(directory)
    except FileNotFoundError:  # another agent's exit removed the shared parent, empty, just now
        _make_private_directories(directory)
    with os.scandir(directory) as entries:
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    return directory


def close_handoff(agent_pid: int) -> None:
    """Remove the agent's files and directory, and the shared parent if no other agent uses it
    (as `rendezvous_figures.remove_file_and_empty_directory` does). Never raises."""
    directory = handoff_directory(agent_pid)
    if _is_private(directory):
        with contextlib.suppress(OSError), os.scandir(directory) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
    with contextlib.suppress(OSError):
        directory.rmdir()
    with contextlib.suppress(OSError):
        directory.parent.rmdir()


def publish_round(agent_pid: int, announcement: RoundAnnouncement) -> None:
    """Tell the workers `announcement`: round.json, written whole. FileNotFoundError before
    `open_handoff`, PermissionError for a directory that is not private."""
    fields = {
        "round": announcement.round,
        "group_rank": announcement.group_rank,
        "group_world_size": announcement.group_world_size,
        "master_addr": announcement.master_addr,
        "master_port": announcement.master_port,
        "in_process": announcement.in_process,
        "joined": announcement.joined,
        "reason": announcement.reason,
        "first_rank": announcement.first_rank,
        "world_size": announcement.world_size,
    }
    _write_whole(handoff_directory(agent_pid) / ROUND_FILE, fields)


def capable_workers(agent_pid: int) -> dict[int, int]:
    """local rank -> local world size, of the valid capable files whose worker process still runs."""
    capable = {}
    for local_rank, path in _ranked_files(agent_pid, CAPABLE_PREFIX):
        fields = _read_json(path)
        if _is_capable_mark(fields, local_rank) and _is_running(fields["pid"]):
            capable[local_rank] = fields["local_world_size"]
    return capable


def all_workers_capable(agent_pid: int) -> int | None:
    """The local world size N when every local rank 0..N-1 runs and declared itself capable with the
    same N; else None (no worker, one missing, world sizes that disagree)."""
    capable = capable_workers(agent_pid)
    world_sizes = set(capable.values())
    if len(world_sizes) != 1:
        return None
    local_world_size = world_sizes.pop()
    return local_world_size if set(capable) == set(range(local_world_size)) else None


def reform_requests(agent_pid: int) -> dict[int, ReformRequest]:
    """local rank -> its request for a new round, of the valid request files."""
    requests = {}
    for local_rank, path in _ranked_files(agent_pid, REQUEST_PREFIX):
        request = _decode(ReformRequest, _read_json(path))
        if request is not None:
            requests[local_rank] = request
    return requests


def clear_requests(agent_pid: int) -> None:
    """Remove every request file (see "Not guaranteed" for when to call it). Never raises."""
    for _, path in _ranked_files(agent_pid, REQUEST_PREFIX):
        with contextlib.suppress(OSError):
            path.unlink()


# --- the workers' side ---


def read_round(agent_pid: int) -> RoundAnnouncement | None:
    """The round the agent published, or None: no file (yet), not this user's, a link, torn, too
    large, not valid, or a directory that is not private."""
    directory = handoff_directory(agent_pid)
    if not _is_private(directory):
        return None
    return _decode(RoundAnnouncement, _read_json(directory / ROUND_FILE))


def declare_capable(agent_pid: int, local_rank: int, local_world_size: int) -> None:
    """Tell the agent that this process (its pid) re-forms in process, as `local_rank` of
    `local_world_size`. ValueError for ranks out of range (TypeError for a rank that is not an int);
    FileNotFoundError when the agent opened
    no directory (it does not re-form in process); PermissionError for one that is not private."""
    _check_int("local_world_size", local_world_size, 1, MAX_LOCAL_WORLD_SIZE)
    _check_int("local_rank", local_rank, 0, local_world_size - 1)
    fields = {"local_rank": local_rank, "local_world_size": local_world_size, "pid": os.getpid()}
    _write_whole(_ranked_file(agent_pid, CAPABLE_PREFIX, local_rank), fields)


def withdraw_capable(agent_pid: int, local_rank: int) -> None:
    """Remove this worker's capable mark (it leaves, or can no longer re-form). Never raises."""
    if not _is_local_rank(local_rank) or not _is_private(handoff_directory(agent_pid)):
        return
    with contextlib.suppress(OSError):
        _ranked_file(agent_pid, CAPABLE_PREFIX, local_rank).unlink()


def request_reform(agent_pid: int, local_rank: int, broken_round: int, reason: str) -> None:
    """Ask the agent for a new round: this worker's process group of `broken_round` broke. `reason`
    is kept to its first line and `MAX_REASON_CHARS`. Errors as `declare_capable`'s."""
    _check_int("local_rank", local_rank, 0, MAX_LOCAL_WORLD_SIZE - 1)
    request = ReformRequest(broken_round, reason)
    fields = {"broken_round": request.broken_round, "reason": request.reason}
    _write_whole(_ranked_file(agent_pid, REQUEST_PREFIX, local_rank), fields)


# --- both sides: paths, checks, whole writes, untrusted reads ---


def _ranked_file(agent_pid: int, prefix: str, local_rank: int) -> Path:
    return handoff_directory(agent_pid) / f"{prefix}{local_rank}.json"


def _ranked_files(agent_pid: int, prefix: str) -> list[tuple[int, Path]]:
    """(local rank, path) of the files named `prefix<rank>.json`; none when the directory is missing
    or not private."""
    directory = handoff_directory(agent_pid)
    if not _is_private(directory):
        return []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    ranked = []
    for name in names:
        match = _RANKED_FILE.fullmatch(name)
        if match and f"{match[1]}-" == prefix and int(match[2]) < MAX_LOCAL_WORLD_SIZE:
            ranked.append((int(match[2]), directory / name))
    return sorted(ranked)


def _make_private_directories(directory: Path) -> None:
    make_private_directory(directory.parent)
    make_private_directory(directory)


def _check_private_directories(directory: Path) -> None:
    """FileNotFoundError when `directory` or its parent is missing, PermissionError when either is
    not a private directory of this user; never creates."""
    for level in (directory.parent, directory):
        info = os.lstat(level)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PermissionError(f"{level} is not a private directory of this user")


def _is_private(directory: Path) -> bool:
    try:
        _check_private_directories(directory)
    except OSError:
        return False
    return True


def _write_whole(path: Path, fields: dict) -> None:
    """`fields` as JSON to `path` through a temporary file of this thread renamed over it, in a
    directory checked private (never made here)."""
    _check_private_directories(path.parent)
    # One temporary name per process and thread: two writers never interleave in one file.
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(handle, "w") as opened:
            opened.write(json.dumps(fields))
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


def _read_json(path: Path) -> object | None:
    """The JSON value in `path`, or None: missing, a link, not a regular file (O_NONBLOCK: a FIFO
    does not block the open), not this user's, over `MAX_FILE_BYTES`, or not JSON."""
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        with os.fdopen(handle, "rb") as opened:
            info = os.fstat(opened.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size > MAX_FILE_BYTES:
                return None
            content = opened.read(MAX_FILE_BYTES + 1)  # the file may have grown since fstat
    except OSError:
        return None
    if len(content) > MAX_FILE_BYTES:
        return None
    try:
        return json.loads(content)
    except (ValueError, RecursionError):  # RecursionError: nested too deep (UnicodeDecodeError is a ValueError)
        return None


def _decode(kind: type, fields: object) -> object | None:
    """`kind` (a dataclass of this module) made from `fields`, or None unless `fields` has exactly its
    fields, valid, with a reason already of one line (as the writers keep it)."""
    if not isinstance(fields, dict) or set(fields) != set(kind.__dataclass_fields__):
        return None
    reason = fields["reason"]
    if not isinstance(reason, str) or reason != _one_line(reason):
        return None
    try:
        return kind(**fields)
    except (TypeError, ValueError):
        return None


def _is_capable_mark(fields: object, local_rank: int) -> bool:
    return (isinstance(fields, dict) and set(fields) == {"local_rank", "local_world_size", "pid"}
            and fields["local_rank"] == local_rank and _is_int(fields["local_rank"])
            and _is_int(fields["local_world_size"]) and local_rank < fields["local_world_size"] <= MAX_LOCAL_WORLD_SIZE
            and _is_int(fields["pid"]) and 0 < fields["pid"] <= MAX_PID)


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:  # ProcessLookupError: gone; PermissionError: the pid is another user's process now
        return False
    return True


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_local_rank(value: object) -> bool:
    return _is_int(value) and 0 <= value < MAX_LOCAL_WORLD_SIZE


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if not _is_int(value):
        raise TypeError(f"{name} {value!r}: an integer is wanted")
    if not low <= value <= high:
        raise ValueError(f"{name} {value!r}: an integer from {low} to {high} is wanted")


def _is_address(value: object) -> bool:
    return (isinstance(value, str) and 0 < len(value) <= MAX_ADDRESS_CHARS and value.isprintable()
            and not any(character.isspace() for character in value))


def _one_line(text: str) -> str:
    lines = text.splitlines()
    return lines[0][:MAX_REASON_CHARS] if lines else ""


def _checked_reason(reason: object) -> str:
    if not isinstance(reason, str):
        raise TypeError(f"reason {reason!r}: a string is wanted")
    return _one_line(reason)
