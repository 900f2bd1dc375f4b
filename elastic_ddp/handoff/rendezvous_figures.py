"""The file through which a node's torchrun agent tells the node's metrics server its rendezvous figures.

The agent (agent/rendezvous_metrics.py) counts its rounds and writes, whole (a rename), after each
change:

    TMPDIR/elastic_ddp-agent-<uid>/rendezvous-<agent pid>.json
    {"pid": 4242, "rounds": 3, "failures": 0, "seconds": 4.81, "last_round_seconds": 1.02,
     "round_started": 1764120000.5}        # Unix time of the round in progress, else null

The node's metrics server (runlog/metrics_agent.py) knows the agent's pid (it watches the agent) and
reads the file at each scrape. This module is the whole contract between the two sides, which
otherwise import nothing of each other (the agent side never imports the worker side): torch-free,
standard library only.

The directory is the user's alone (0700, checked on every write); a reader trusts a file only if
this user owns it, it is not a link, and it names the pid asked for. The file holds counts and
times, nothing of the job's settings.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

DIRECTORY_PREFIX = "elastic_ddp-agent-"
FILE_PREFIX = "rendezvous-"


def rendezvous_file(pid: int) -> Path:
    """Where the agent of `pid` (of this user) keeps its rendezvous figures."""
    return Path(tempfile.gettempdir()) / f"{DIRECTORY_PREFIX}{os.getuid()}" / f"{FILE_PREFIX}{pid}.json"


def write_figures(path: Path, figures: dict[str, Any]) -> None:
    """`figures` to `path`, whole (a temporary file renamed over it), in this user's private
    directory (made if missing); OSError (PermissionError for a directory that is not private)."""
    make_private_directory(path.parent)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(figures))
    os.replace(temporary, path)


def read_figures(pid: int) -> dict | None:
    """The figures of the agent `pid`, or None (no file yet, not this user's, a link, torn, another pid's)."""
    path = rendezvous_file(pid)
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(handle) as opened:
        if os.fstat(opened.fileno()).st_uid != os.getuid():
            return None
        try:
            figures = json.loads(opened.read())
        except ValueError:
            return None
    return figures if isinstance(figures, dict) and figures.get("pid") == pid else None


def remove_file_and_empty_directory(path: Path) -> None:
    """Delete an agent's file, then its directory if that is empty now (rmdir refuses otherwise)."""
    with contextlib.suppress(OSError):
        path.unlink()
    with contextlib.suppress(OSError):
        path.parent.rmdir()


def make_private_directory(directory: Path) -> None:
    """`directory`, made 0700 if missing; PermissionError unless it is a directory of this user
    that no one else may enter (a link, another user's or an open one is refused)."""
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{directory} is not a private directory of this user")
