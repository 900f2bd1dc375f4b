"""The agent's rendezvous rounds and the time they take, in a small file that the node's metrics server reads.

The torchrun agent runs our rendezvous handler (`--rdzv_backend=elastic-c10d` or `etcd-v3`, and
`c10d` under `python -m elastic_ddp.agent.launcher`); `count_rounds(handler)` wraps its
`next_rendezvous`, so that every round, from the agent's entry to the worker group's world, is
counted, and its `reform_in_process`, the rounds it runs for its running workers (a lost node's
survivors re-form in process, issue 44): one taken in process counts as a round; one given up
counts its time only (torchrun's restart then enters that round through `next_rendezvous`).
After each change this agent writes its figures to `rendezvous_file(its pid)`, the file
whose format and checks `elastic_ddp.handoff.rendezvous_figures` holds, the whole contract with the node's
metrics server (runlog/metrics_agent.py), which serves them as `elastic_ddp_agent_rendezvous_*`.

The file is removed when the agent exits normally, by the metrics server when the agent has ended
(a SIGKILLed one), and else by the next agent of the user on the machine (the files of pids that no
longer run); the directory goes with the last file. Writing it never stops the agent: a failure is
logged once.

Not guaranteed: with torch's own `--rdzv_backend=c10d` under plain torchrun our code does not run
in the agent, so there is no file and no series. The counts are the agent's own: a node restarted
in place starts again from 0 (Prometheus's rate() and increase() handle counter resets).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from elastic_ddp.handoff.rendezvous_figures import (
    FILE_PREFIX,
    remove_file_and_empty_directory,
    rendezvous_file,
    write_figures,
)

logger = logging.getLogger(__name__)

Handler = TypeVar("Handler")


class RendezvousRounds:
    """This agent's rounds: counted by `next_rendezvous` (wrapped), written to `path` after each change."""

    def __init__(self, path: Path):
        self.path = path
        self.pid = os.getpid()
        self.rounds = self.failures = 0
        self.seconds = self.last_round_seconds = 0.0
        self.round_started: float | None = None
        self._lock = threading.Lock()
        self._broken = False

    def wrap(self, call, completed: Callable[[Any], bool] = lambda result: True):
        """`call`, a round, counted: as a round when it returns a result that `completed` accepts,
        as a failure when it raises, else its time only."""
        @functools.wraps(call)
        def counted(*args, **kwargs):
            self._round_began()
            outcome: bool | None = False
            try:
                result = call(*args, **kwargs)
                outcome = True if completed(result) else None
                return result
            finally:
                self._round_ended(outcome)
        return counted

    def figures(self) -> dict[str, Any]:
        return {"pid": self.pid, "rounds": self.rounds, "failures": self.failures, "seconds": round(self.seconds, 6),
                "last_round_seconds": round(self.last_round_seconds, 6), "round_started": self.round_started}

    def write(self) -> None:
        """The figures to the file, whole; a failure is logged once and never raised."""
        if self._broken:
            return
        try:
            try:
                self._write_once()
            except FileNotFoundError:  # another agent's exit removed the directory, empty, just now
                self._write_once()
        except OSError as exc:
            self._broken = True
            logger.warning("rendezvous metrics: cannot write %s (%s); the node's metrics endpoint will not show "
                           "this agent's rendezvous rounds", self.path, exc)

    def _write_once(self) -> None:
        write_figures(self.path, self.figures())

    def remove(self) -> None:
        """The agent exits: remove the file (only the process that wrote it), and the directory if
        no other agent's file is in it."""
        if os.getpid() == self.pid:
            remove_file_and_empty_directory(self.path)

    def _round_began(self) -> None:
        with self._lock:
            self.round_started = time.time()
            self.write()

    def _round_ended(self, ok: bool | None) -> None:
        with self._lock:
            # The server adds `now - round_started` for a round in progress: the same clock here keeps
            # the served total from going down when the round ends.
            seconds = max(0.0, time.time() - self.round_started) if self.round_started is not None else 0.0
            if ok:
                self.rounds += 1
            elif ok is not None:
                self.failures += 1
            self.seconds += seconds
            self.last_round_seconds = seconds
            self.round_started = None
            self.write()


def count_rounds(handler: Handler) -> Handler:
    """`handler` (a RendezvousHandler) whose `next_rendezvous` counts its rounds (module docstring).
    Its type stays torch's: only the instance's method is replaced."""
    rounds = RendezvousRounds(rendezvous_file(os.getpid()))
    rounds.write()
    remove_files_of_ended_agents(rounds.path.parent)
    atexit.register(rounds.remove)
    handler.next_rendezvous = rounds.wrap(handler.next_rendezvous)
    if hasattr(handler, "reform_in_process"):  # 0: this node's workers re-formed in the round
        handler.reform_in_process = rounds.wrap(handler.reform_in_process, completed=lambda waiting: waiting == 0)
    return handler


def remove_files_of_ended_agents(directory: Path) -> None:
    """Delete the files of agents (of this user) that no longer run: killed with their whole node."""
    for path in directory.glob(f"{FILE_PREFIX}*.json"):
        pid = path.stem.removeprefix(FILE_PREFIX)
        if pid.isdigit() and not _is_running(int(pid)):
            with contextlib.suppress(OSError):
                path.unlink()


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
