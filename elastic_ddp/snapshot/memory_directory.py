"""Where the memory copies of a node live, and who may own that place.

/dev/shm is shared by every user of the machine. `make_private_run_directory` (at the start of a
worker group) refuses, with one error naming the path and the fix, a memory directory any of whose
ancestors belongs to another user than root or us, or that others could write without a sticky
bit; the run's directory is created private (0700) and used only while it belongs to this user
alone. Its name holds the checkpoint directory's scope token (snapshot/memory_copies.py), which
only readers of the checkpoint directory know: another user cannot squat it from what `ps` shows.

Cleaning: `remove_abandoned_runs` (a node's local rank 0, at each start) removes the copies of this
user's other runs in the memory directory whose torchrun agent has ended (`record_agent` notes it
in each run's directory) and that nobody touched for `ABANDONED_AFTER_S` (a day): a run cancelled
or failed for good. The current run's copies are never removed there; another run relaunched after
more than a day loses only its memory copy (it resumes from its snapshot files).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import time
from pathlib import Path

from elastic_ddp.runtime.procfs import read_stat
from elastic_ddp.snapshot.files.errors import SnapshotError

logger = logging.getLogger(__name__)

RUN_DIRECTORY_PATTERN = re.compile(r"^elastic_ddp-[0-9a-f]{20}$")  # not the metrics' elastic_ddp-metrics-*
AGENT_NAME = "agent"  # "<pid> <start ticks>" of the torchrun agent of the run's latest worker group here
ABANDONED_AFTER_S = 24 * 3600  # another run's copies, untouched this long with its agent gone, are removed


def make_private_run_directory(root: Path, directory: Path) -> None:
    """Create the run directory as 0700; refuse one that is not this user's alone, or a root
    in which others could replace it."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_ancestors(root)
    check_parent(root)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    check_private(directory)


def record_agent(directory: Path, agent_pid: int) -> None:
    """Record `agent_pid` (the node's torchrun agent, with its start time) as the owner of `directory`."""
    process = read_stat(agent_pid)
    temporary = directory / f".{AGENT_NAME}.tmp-{os.getpid()}"
    temporary.write_text(f"{agent_pid} {process.start_ticks if process is not None else 0}\n")
    os.replace(temporary, directory / AGENT_NAME)


def remove_abandoned_runs(root: Path, this_run: Path) -> None:
    """Remove this user's other runs' directories whose agent has ended and that nobody
    touched for ABANDONED_AFTER_S; never this run's, never what is not plainly ours."""
    now = time.time()
    for name in os.listdir(root):
        directory = root / name
        if directory == this_run or not RUN_DIRECTORY_PATTERN.match(name):
            continue
        try:
            check_private(directory)
            if _agent_runs(directory / AGENT_NAME):
                continue
            touched = max([modified_time(directory), *(modified_time(directory / entry) for entry in os.listdir(directory))])
        except (OSError, SnapshotError):
            continue
        if now - touched > ABANDONED_AFTER_S:
            shutil.rmtree(directory, ignore_errors=True)
            logger.info("removed the memory copies of an abandoned run: %s (its torchrun agent has ended, "
                        "untouched for %.1f days)", directory, (now - touched) / 86400)


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


def _agent_runs(record: Path) -> bool:
    """Whether the agent recorded in `record` ("<pid> <start ticks>") still runs; False without one."""
    try:
        pid, ticks = (int(field) for field in record.read_text().split())
    except (OSError, ValueError):
        return False
    process = read_stat(pid)
    return process is not None and process.state != "Z" and process.start_ticks == ticks


def check_private(directory: Path) -> None:
    """SnapshotError unless `directory` is a real directory of this user that only it can write."""
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise SnapshotError(f"{directory} is not a private directory of this user (owner uid {info.st_uid}, "
                            f"mode {stat.filemode(info.st_mode)}): remove it if you did not create it, or choose "
                            "another --memory_dir")


def check_parent(directory: Path) -> None:
    """SnapshotError when others could replace `directory`'s entries (writable by all, not sticky)."""
    mode = os.stat(directory).st_mode
    if mode & 0o002 and not mode & stat.S_ISVTX:
        raise SnapshotError(f"{directory} is writable by every user and not sticky (mode {stat.filemode(mode)}); "
                            "choose another --memory_dir")


def modified_time(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # pruned by a sibling meanwhile
        return 0.0
