"""Memory copies: the state of the last committed step, kept in node-local memory as a worker stops.

When a worker group breaks (a peer died and a collective failed, torchrun stopped the workers
with SIGTERM to re-form the group, the watchdog found a peer silent) every surviving DDP rank still
holds the whole model and optimizer state of the last step it committed. Before the worker
exits, `MemoryTier.keep` writes it to a directory in node-local memory (`--memory_dir`, by default
/dev/shm): a self-describing snapshot file (`snapshot.files.file_layout`: header, payload, checksum),
written to a temporary name and renamed, so a copy is whole or absent. The next worker
group on that node offers it in the restore agreement next to the snapshot files; the newest state
wins, a memory copy wins a tie, and its holder serves it to the ranks that lack it. So a failure
costs the survivors no committed step, whatever the snapshot cadence. The state of a diverged run
(a NaN or an infinity in any floating-point tensor) is never kept, and a copy that holds one (kept
by a version that did not check) is refused like a damaged one: the restart takes the last finite
state instead (a pass over the state at each keep and each restore, none while training).

Scope: the copies of one run live in `<memory_dir>/elastic_ddp-<hash>`, the hash of the user, the
run id, the checkpoint directory and its scope token (a random id created once in the checkpoint
directory, in the visible file `memory-scope`, so that `rm -r CHECKPOINT_DIR/*` removes it too);
each copy carries the run's fingerprint and that token. A copy of another model or data set-up, or
of an earlier run whose checkpoint directory was since created anew or emptied, is refused with a
line that says so (and a stale one removed), as is a torn or damaged one. Copies are pruned to the
newest two, and removed when the run finishes.

Identity: a copy is the state of (step, incarnation), the incarnation that committed that step
(a restore that has not trained since keeps the restored state's). After a rollback to an older
snapshot, the retrained step N is another state than the old trajectory's step N: both are kept,
and the later incarnation is the newer (also in the restore agreement).

One copy per node: the ranks of a node hold the same state (DDP), so they take turns under a
file lock and the first one writes; the others find its copy of the same (step, incarnation),
check its header and trailer (a torn or foreign one is replaced, not reused) and are done. A rank
that waited `LOCK_WAIT_S` for the lock (its holder frozen) writes a copy of its own.

Opening: both sessions (DDP and sharded) open the node's memory directory with `open_memory_tier`
at the start of a worker group. /dev/shm is shared by every user of the machine: opening refuses,
with one error naming the path and the fix, a memory directory any of whose ancestors belongs to
another user than root or us, or that others could write without a sticky bit; the run's directory
is created private (0700) and used only while it belongs to this user alone. Its name holds the
scope token, which only readers of the checkpoint directory know: another user cannot squat it
from what `ps` shows. A copy is read as untrusted bytes all the same (its own checksum,
weights_only=True, the fingerprint and scope).

Cleaning: at each start a node's local rank 0 removes the copies of this user's other runs in the
memory directory whose torchrun agent has ended (each run's directory records its agent) and that
nobody touched for `ABANDONED_AFTER_S` (a day): a run cancelled or failed for good. The current
run's copies are never removed there; another run relaunched after more than a day loses only its
memory copy (it resumes from its snapshot files).

Limits: a copy is written at memory speed (its pages allocated in tmpfs as it is written, the hash
on a second thread alongside: 0.42 s per GB alone on this project's 2-core VM, 0.6-2.1 s per GB at a
kill beside a snapshot write; docs/benchmarks.md), while torchrun waits for
the worker (it SIGKILLs it 30 s after SIGTERM: a state that takes longer to write is not kept, and
the temporary file the kill leaves is removed by the next keep or restore on that node). A state
that does not fit in the memory directory's free space is not kept (a warning says so, and the
restart falls back to the snapshot files). /dev/shm is RAM: a copy costs as much memory as the
state (up to KEEP copies, one more while a new one is written), until the end of the run removes
them. A copy survives the worker, not the machine. Not guaranteed: a copy when the whole node
dies (its survivors on other nodes keep theirs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import logging
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic_ddp.runtime.distributed import DistributedContext, agent_pid
from elastic_ddp.runtime.procfs import process_is_alive, read_stat
from elastic_ddp.snapshot.files.backends import StorageBackend
from elastic_ddp.snapshot.files.errors import IncompatibleSnapshotError, NonFiniteStateError, SnapshotError
from elastic_ddp.snapshot.files.file_layout import HEAD_BYTES, TRAILER_BYTES, Seal, read_seal
from elastic_ddp.snapshot.serialization import check_compatible, snapshot_from_file, write_snapshot
from elastic_ddp.snapshot.training_state import Snapshot, check_finite

logger = logging.getLogger(__name__)

SCOPE_TOKEN_NAME = "memory-scope"  # visible: `rm -r CHECKPOINT_DIR/*` removes it with the snapshots
TOKEN_LENGTH = 32
TOKEN_PATTERN = re.compile(r"[0-9a-f]{32}")
SCOPE_KEY = "memory_scope"  # the fingerprint key that ties a copy to its checkpoint directory
# memory-<step>-<incarnation>-<random>.pt (earlier versions wrote no incarnation: read as 0)
COPY_PATTERN = re.compile(r"^memory-(\d{9})(?:-(\d{1,19}))?-[0-9a-f]{8}\.pt$")
TEMPORARY_PATTERN = re.compile(r"^\.memory-\d{9}(?:-\d{1,19})?-[0-9a-f]{8}\.pt\.tmp-(\d+)$")
LOCK_NAME = ".lock"
KEEP = 2  # copies per node: the newest, and the one before it in case the newest is refused
HEADROOM = 1.1  # free space a copy needs, relative to the state's size
LOCK_WAIT_S = 10.0  # how long a rank waits for a sibling that is writing the node's copy
RUN_DIRECTORY_PATTERN = re.compile(r"^elastic_ddp-[0-9a-f]{20}$")  # not the metrics' elastic_ddp-metrics-*
AGENT_NAME = "agent"  # "<pid> <start ticks>" of the torchrun agent of the run's latest worker group here
ABANDONED_AFTER_S = 24 * 3600  # another run's copies, untouched this long with its agent gone, are removed


@dataclass(frozen=True)
class MemoryCopy:
    """A verified memory copy of this node."""

    path: Path
    global_step: int
    incarnation: int  # the incarnation that committed the step (see the module docstring)
    checksum: str
    size_bytes: int
    snapshot: Snapshot  # loaded from the file; the model's tensors are views onto it, mapped privately


@dataclass(frozen=True)
class KeptCopy:
    """What `MemoryTier.keep` did."""

    path: Path
    size_bytes: int
    seconds: float
    written: bool  # False: a sibling rank of this node had already kept this step


def scope_token(storage: StorageBackend) -> str:
    """The checkpoint directory's scope token, created on first use (every rank reads the same one).

    SnapshotError when the file there is not a token (32 hex digits): it is read as untrusted input.
    """
    raw = storage.create_if_absent(SCOPE_TOKEN_NAME, secrets.token_hex(16).encode(), limit=TOKEN_LENGTH)
    token = raw.decode("ascii", errors="replace")
    if not TOKEN_PATTERN.fullmatch(token):
        raise SnapshotError(f"{storage.describe(SCOPE_TOKEN_NAME)} is not a scope token (32 hex digits); remove it")
    return token


def state_bytes(states: Any) -> int:
    """The bytes of every tensor in `states` (what a copy of it will take, about)."""
    if isinstance(states, torch.Tensor):
        return states.numel() * states.element_size()
    if isinstance(states, dict):
        return sum(state_bytes(value) for value in states.values())
    if isinstance(states, (list, tuple)):
        return sum(state_bytes(value) for value in states)
    return 0


def open_memory_tier(memory_dir: str, checkpoint_storage: StorageBackend, context: DistributedContext,
                     fingerprint: dict[str, Any]) -> MemoryTier | None:
    """This node's memory copies of the run, opened at the start of a worker group (by both sessions).

    Reads the checkpoint directory's scope token (created on first use), checks the memory
    directory and creates this run's private directory in it (`MemoryTier.open`), owned by the
    node's torchrun agent (without torchrun: by this process); the node's local rank 0 also removes
    other runs' abandoned copies. None when this node cannot keep memory copies in this worker group
    (no scope token; a memory directory that is not safe or not writable): every rank of the node
    logs why, its local rank 0 as an error, the others at INFO (the same directory: they would only
    repeat it).
    """
    first_of_node = context.local_rank == 0
    report = logger.error if first_of_node else logger.info
    location = checkpoint_storage.describe("").rstrip("/")
    try:
        token = scope_token(checkpoint_storage)
    except (OSError, SnapshotError) as exc:
        report("memory copies are off on this node for this worker group: no scope token in %s (%s)", location, exc)
        return None
    tier = MemoryTier(memory_dir, context.run_id, location, fingerprint, token)
    try:
        tier.open(remove_abandoned=first_of_node,
                  agent_pid=agent_pid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid())
    except (OSError, SnapshotError) as exc:
        report("memory copies are off on this node for this worker group: %s", exc)
        return None
    return tier


def _make_private_run_directory(root: Path, directory: Path) -> None:
    """Create the run directory as 0700; refuse one that is not this user's alone, or a root
    in which others could replace it."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_ancestors(root)
    _check_parent(root)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    _check_private(directory)


def _check_ancestors(root: Path) -> None:
    """SnapshotError when another user than root or us could replace `root` or a directory above
    it: one that belongs to them, or that others may write to without a sticky bit."""
    for directory in [root.resolve(), *root.resolve().parents]:
        info = os.stat(directory)
        if info.st_uid not in (0, os.getuid()):
            raise SnapshotError(f"--memory_dir {root}: {directory} belongs to uid {info.st_uid}, who could replace "
                                "the memory copies; choose a --memory_dir under directories of root or yours "
                                "(the default /dev/shm is)")
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX and directory != root.resolve():
            raise SnapshotError(f"--memory_dir {root}: {directory} is writable by others and not sticky (mode "
                                f"{stat.filemode(info.st_mode)}); choose a --memory_dir under directories that "
                                "only root or you can write")


def _check_private(directory: Path) -> None:
    """SnapshotError unless `directory` is a real directory of this user that only it can write."""
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise SnapshotError(f"{directory} is not a private directory of this user (owner uid {info.st_uid}, "
                            f"mode {stat.filemode(info.st_mode)}): remove it if you did not create it, or choose "
                            "another --memory_dir")


def _check_parent(directory: Path) -> None:
    """SnapshotError when others could replace `directory`'s entries (writable by all, not sticky)."""
    mode = os.stat(directory).st_mode
    if mode & 0o002 and not mode & stat.S_ISVTX:
        raise SnapshotError(f"{directory} is writable by every user and not sticky (mode {stat.filemode(mode)}); "
                            "choose another --memory_dir")


def _record_agent(directory: Path, agent_pid: int) -> None:
    """Record `agent_pid` (the node's torchrun agent, with its start time) as the owner of `directory`."""
    process = read_stat(agent_pid)
    temporary = directory / f".{AGENT_NAME}.tmp-{os.getpid()}"
    temporary.write_text(f"{agent_pid} {process.start_ticks if process is not None else 0}\n")
    os.replace(temporary, directory / AGENT_NAME)


def _remove_abandoned_runs(root: Path, this_run: Path) -> None:
    """Remove this user's other runs' directories whose agent has ended and that nobody
    touched for ABANDONED_AFTER_S; never this run's, never what is not plainly ours."""
    now = time.time()
    for name in os.listdir(root):
        directory = root / name
        if directory == this_run or not RUN_DIRECTORY_PATTERN.match(name):
            continue
        try:
            _check_private(directory)
            if _agent_runs(directory / AGENT_NAME):
                continue
            touched = max([_modified_time(directory),
                           *(_modified_time(directory / entry) for entry in os.listdir(directory))])
        except (OSError, SnapshotError):
            continue
        if now - touched > ABANDONED_AFTER_S:
            shutil.rmtree(directory, ignore_errors=True)
            logger.info("removed the memory copies of an abandoned run: %s (its torchrun agent has ended, "
                        "untouched for %.1f days)", directory, (now - touched) / 86400)


def _agent_runs(record: Path) -> bool:
    """Whether the agent recorded in `record` ("<pid> <start ticks>") still runs; False without one."""
    try:
        pid, ticks = (int(field) for field in record.read_text().split())
    except (OSError, ValueError):
        return False
    process = read_stat(pid)
    return process is not None and process.state != "Z" and process.start_ticks == ticks


def _modified_time(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # pruned by a sibling meanwhile
        return 0.0


class MemoryTier:
    """This node's memory copies of one run (see the module docstring).

    `root` is --memory_dir; `run_id` and `checkpoint_location` name the run (torchrun's --rdzv_id,
    --checkpoint_dir); `fingerprint` is the run's; `token` the checkpoint directory's scope token.
    """

    def __init__(self, root: str | os.PathLike, run_id: str, checkpoint_location: str, fingerprint: dict[str, Any],
                 token: str):
        # The token makes the name unguessable for other users (it is not in any command line).
        scope = hashlib.sha256(f"{os.getuid()}\0{run_id}\0{checkpoint_location}\0{token}".encode()).hexdigest()[:20]
        self.root = Path(root)
        self.directory = self.root / f"elastic_ddp-{scope}"
        self.fingerprint = {**fingerprint, SCOPE_KEY: token}
        self.refusal: str | None = None  # why the last `keep` kept nothing
        self._refused_step: int | None = None  # the last step refused as non-finite (logged once)

    def open(self, *, remove_abandoned: bool = False, agent_pid: int | None = None) -> None:
        """At the start of a worker group: check the memory directory and create this run's private
        directory; record `agent_pid` (the node's torchrun agent) as its owner; with
        `remove_abandoned`, remove other runs' abandoned copies (see the module docstring).

        SnapshotError (one line: the path and the fix) when the directory is not safe to use.
        """
        _make_private_run_directory(self.root, self.directory)
        if agent_pid is not None:
            _record_agent(self.directory, agent_pid)
        if remove_abandoned:
            _remove_abandoned_runs(self.root, self.directory)

    def free_bytes(self) -> int:
        """The free space of the memory directory."""
        return shutil.disk_usage(self.directory if self.directory.is_dir() else self.root).free

    # ---------------------------------------------------------------------------------- keeping

    def keep(self, snapshot: Snapshot) -> KeptCopy | None:
        """Make `snapshot` (its fingerprint replaced by this tier's) this node's newest copy.

        `snapshot.incarnation` names the incarnation that committed its step: a copy of the same
        (step, incarnation) that a sibling rank wrote, whole and of this run, is reused.
        Returns what was done, or None when nothing was kept (a state with a NaN or an infinity, no
        room, an unsafe directory, an I/O error: logged, and said in `refusal`). Never raises an
        OSError or SnapshotError.
        """
        started = time.monotonic()
        self.refusal = None
        try:
            check_finite(snapshot.states, f"the state of step {snapshot.global_step}")
        except NonFiniteStateError as exc:
            self.refusal = str(exc)
            if self._refused_step != snapshot.global_step:  # once, not once per rank or per attempt
                self._refused_step = snapshot.global_step
                logger.error("%s: not kept in memory (a restart resumes from the last finite state)", exc)
            return None
        try:
            _make_private_run_directory(self.root, self.directory)
            with self._node_lock():
                existing = self._same_copy(snapshot.global_step, snapshot.incarnation)
                if existing is not None:
                    return KeptCopy(existing, existing.stat().st_size, time.monotonic() - started, written=False)
                self._remove_abandoned_temporaries()
                needed = state_bytes(snapshot.states) * HEADROOM
                free = shutil.disk_usage(self.directory).free
                if needed > free:
                    self.refusal = f"it needs {needed / 1e9:.2f} GB, {self.directory} has {free / 1e9:.2f} GB free"
                    logger.warning("the state of step %d (%.2f GB) does not fit in %s (%.2f GB free): not kept in "
                                   "memory; a restart falls back to the snapshot files", snapshot.global_step,
                                   needed / 1e9, self.directory, free / 1e9)
                    return None
                path = self._write(dataclasses.replace(snapshot, fingerprint=self.fingerprint))
                self._prune()
            return KeptCopy(path, path.stat().st_size, time.monotonic() - started, written=True)
        except (OSError, SnapshotError) as exc:
            self.refusal = str(exc)
            logger.error("the state of step %d was not kept in memory (%s)", snapshot.global_step, exc)
            return None

    @contextlib.contextmanager
    def _node_lock(self) -> Iterator[None]:
        """Exclusive among this node's ranks, for at most LOCK_WAIT_S (then without it)."""
        handle = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        logger.warning("a sibling rank holds %s for over %.0f s: writing a copy of this rank's own",
                                       self.directory / LOCK_NAME, LOCK_WAIT_S)
                        break
                    time.sleep(0.01)  # polling: flock has no timeout, and the holder is writing
            yield
        finally:
            os.close(handle)  # releases the lock

    def _same_copy(self, global_step: int, incarnation: int) -> Path | None:
        """A copy of (global_step, incarnation) that is whole (header and trailer) and of this run;
        one that is not is removed, so that it never stands in for a good one."""
        for path, step, copy_incarnation in self._files():
            if (step, copy_incarnation) != (global_step, incarnation):
                continue
            try:
                with open(path, "rb") as handle:
                    head = handle.read(HEAD_BYTES)
                    size = os.fstat(handle.fileno()).st_size
                    handle.seek(max(size - TRAILER_BYTES, 0))
                    seal = read_seal(head, handle.read(TRAILER_BYTES), size, str(path))
                header = seal.header
                if (header.global_step, header.incarnation, header.fingerprint) != (step, incarnation,
                                                                                    self.fingerprint):
                    raise SnapshotError(f"{path}: another state than its name says")
            except FileNotFoundError:
                continue
            except SnapshotError as exc:
                logger.warning("memory copy replaced: %s", exc)
                path.unlink(missing_ok=True)
                continue
            return path
        return None

    def _write(self, snapshot: Snapshot) -> Path:
        path = self.directory / (f"memory-{snapshot.global_step:09d}-{snapshot.incarnation}-"
                                 f"{secrets.token_hex(4)}.pt")
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
                write_snapshot(snapshot, handle)
            os.replace(temporary, path)  # whole or absent: a reader never sees a part
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise
        return path

    def _files(self) -> list[tuple[Path, int, int]]:
        """(path, step, incarnation) of the copies present, newest first."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        found = [(self.directory / name, int(match.group(1)), int(match.group(2) or 0))
                 for name in names if (match := COPY_PATTERN.match(name))]
        return sorted(found, key=lambda item: (item[1], item[2], _modified_time(item[0])), reverse=True)

    def _prune(self) -> None:
        for path, _, _ in self._files()[KEEP:]:
            path.unlink(missing_ok=True)

    def _remove_abandoned_temporaries(self) -> None:
        """Remove the partial copies of workers that were killed while writing them."""
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.directory):
                match = TEMPORARY_PATTERN.match(name)
                if match and not process_is_alive(int(match.group(1))):
                    (self.directory / name).unlink(missing_ok=True)

    # ---------------------------------------------------------------------------------- reading

    def newest(self, on_refused: Callable[[int, SnapshotError], None] | None = None) -> MemoryCopy | None:
        """This node's newest copy that is whole, verifies, belongs to this run and is finite; every
        newer one that is not is reported, passed to `on_refused(step, error)` and skipped."""
        if not self.directory.is_dir():
            return None
        try:
            _check_parent(self.root)
            _check_private(self.directory)
        except SnapshotError as exc:
            logger.warning("memory copies not used: %s", exc)
            return None
        self._remove_abandoned_temporaries()
        for path, step, incarnation in self._files():
            try:  # verified, then its header checked, and only then its payload loaded
                snapshot, seal = snapshot_from_file(path, str(path), functools.partial(
                    self._check_header, path=path, step=step, incarnation=incarnation), model_as_views=True)
                check_compatible(snapshot, {key: value for key, value in self.fingerprint.items()
                                            if key != SCOPE_KEY}, str(path))
                check_finite(snapshot.states, str(path))  # a copy kept by a version that did not check
            except StaleCopyError as exc:
                logger.warning("memory copy refused and removed: %s", exc)
                path.unlink(missing_ok=True)  # no later run of this directory can use it
                if on_refused is not None:
                    on_refused(step, exc)
                continue
            except (OSError, SnapshotError) as exc:
                logger.warning("memory copy refused: %s", exc)
                if on_refused is not None:
                    on_refused(step, exc if isinstance(exc, SnapshotError) else SnapshotError(f"{path}: {exc}"))
                continue
            return MemoryCopy(path, step, seal.header.incarnation, seal.checksum, seal.size_bytes, snapshot)
        return None

    def newest_listed(self) -> tuple[int, int] | None:
        """(step, incarnation) of the newest copy by its name alone: what `newest` returns at best."""
        files = self._files()
        return (files[0][1], files[0][2]) if files else None

    def _check_header(self, seal: Seal, path: Path, step: int, incarnation: int) -> None:
        header = seal.header
        if (header.global_step, header.incarnation) != (step, incarnation or header.incarnation):
            raise SnapshotError(f"{path}: its header says step {header.global_step} of incarnation {header.incarnation}")
        if header.fingerprint.get(SCOPE_KEY) != self.fingerprint[SCOPE_KEY]:
            raise StaleCopyError(f"{path} is stale: it is from an earlier run whose checkpoint directory has since "
                                 "been created anew or emptied")

    def clear(self) -> None:
        """Remove this run's copies (the run is finished: its final state is on disk)."""
        shutil.rmtree(self.directory, ignore_errors=True)


class StaleCopyError(IncompatibleSnapshotError):
    """A copy of an earlier run of the checkpoint directory (another scope token)."""
