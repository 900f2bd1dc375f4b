"""What Linux's /proc says about a process: the one parser of `/proc/<pid>/stat` in the package.

Used to find a worker's agent (`distributed.agent_pid`), to date a process's start
(`runlog.startup`), to walk and signal a node's process tree (`chaos.cluster`) and, in the
benchmarks, to split CPU time per thread.

Not guaranteed: anything off Linux. Every reader returns None (or an empty result) where /proc is
missing or the process is gone, and never raises for that.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessStat:
    """The fields of `/proc/<pid>/stat` (or `/proc/<pid>/task/<tid>/stat`) that we use."""

    state: str  # R, S, D, Z (zombie: exited, not yet reaped), T (stopped), ...
    parent: int
    user_ticks: int  # CPU time in clock ticks (os.sysconf("SC_CLK_TCK") a second)
    system_ticks: int
    start_ticks: int  # clock ticks after boot at which the process started

    @classmethod
    def parse(cls, text: str) -> ProcessStat:
        """Parse the line of a stat file. The command name, field 2, may hold spaces and
        parentheses, so the fields are counted after its last ')'."""
        fields = text.rsplit(")", 1)[1].split()
        return cls(state=fields[0], parent=int(fields[1]), user_ticks=int(fields[11]),
                   system_ticks=int(fields[12]), start_ticks=int(fields[19]))


def read_stat(pid: int | str = "self", thread: int | None = None) -> ProcessStat | None:
    """The stat of process `pid` (of its thread `thread` if given); None when it cannot be read."""
    path = f"/proc/{pid}/task/{thread}/stat" if thread is not None else f"/proc/{pid}/stat"
    try:
        return ProcessStat.parse(Path(path).read_text())
    except (OSError, ValueError, IndexError):
        return None


def process_name(pid: int | str) -> str:
    """The name of `pid` (/proc/<pid>/comm: at most 15 bytes, set by exec or PR_SET_NAME; "" when
    it cannot be read)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text(errors="replace").rstrip("\n")
    except OSError:
        return ""


def command_line(pid: int | str) -> bytes:
    """The NUL-separated argv of `pid` (b"" when it cannot be read)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def process_start_unix(pid: int | str = "self") -> float | None:
    """When process `pid` started, in Unix seconds (to the kernel's clock tick, 10 ms)."""
    stat = read_stat(pid)
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if stat is None:
        return None
    started_after_boot = stat.start_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - (uptime - started_after_boot)


def process_is_alive(pid: int) -> bool:
    """Whether `pid` runs: it exists and is not a zombie (one that has exited, not yet reaped)."""
    stat = read_stat(pid)
    return stat is not None and stat.state != "Z"


def children_by_parent() -> dict[int, list[int]]:
    """Every process's children, read from /proc at one moment."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if entry.isdigit():
            stat = read_stat(entry)
            if stat is not None:  # None: the process ended while we looked
                children.setdefault(stat.parent, []).append(int(entry))
    return children


def process_tree(root_pid: int) -> list[int]:
    """`root_pid` and every live descendant of it, parents before children."""
    children = children_by_parent()
    tree, frontier = [], [root_pid]
    while frontier:
        pid = frontier.pop()
        tree.append(pid)
        frontier.extend(children.get(pid, []))
    return tree
