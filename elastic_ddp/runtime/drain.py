"""Draining a node on SIGTERM: every rank agrees, a final snapshot is made durable, all ranks exit.

This is how a node leaves a running job on purpose (a spot-instance notice, a scheduler taking the
machine back): send SIGTERM to that node's torchrun agent. The agent forwards SIGTERM to its
workers and SIGKILLs them if they are still alive `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds later
(torch's default: 30). Because it ends on a signal, the agent does NOT close the rendezvous, so the
other nodes can go on without it (docs/failure-semantics.md, "Draining a node").

In the worker, `DrainSignal` turns SIGTERM into a flag. The ranks agree on the flags with a small
all-reduce (MAX) that is started at one step boundary and read at the next vote, so it overlaps the
steps in between and costs no waiting. A collective still costs CPU (on gloo, 0.3-0.6 ms on a small
machine: several percent of a step of a few milliseconds), so the ranks vote about every
`VOTE_INTERVAL_S` seconds rather than at every step: each vote also carries every rank's seconds
per step since the previous vote, and the slowest of them sets the number of steps to the next
vote, the same on every rank. Ranks therefore learn of a SIGTERM within two votes: about
2 x `VOTE_INTERVAL_S`, or two steps when a step is longer than that. Once they agree, the trainer
writes a final snapshot, waits until it is durable and raises `DrainRequested` on every rank.
`python -m elastic_ddp.train` then exits with `DRAIN_EXIT_CODE`: never 0, because a worker group
that exits 0 makes its agent close the rendezvous for every node (torch's `launch_agent` calls
`rdzv_handler.shutdown()` on success).
The other nodes' agents see a failed group and restart it in a new rendezvous round without the
drained node; the restore then loses no step.

Not guaranteed: a SIGTERM that arrives before training starts (while importing or restoring) is
acted on only at the first step boundary, and one that the agent escalates to SIGKILL before the
snapshot is durable leaves the previous periodic snapshot as the newest. SIGTERM sent to a worker
instead of its agent is handled the same way, but that node's agent then restarts its workers and
the node stays in the job.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# EX_TEMPFAIL from sysexits.h: "try again later". Any non-zero code keeps the rendezvous open.
DRAIN_EXIT_CODE = 75
# Seconds between drain votes (see the module docstring); at most MAX_STEPS_BETWEEN_VOTES steps.
VOTE_INTERVAL_S = 0.25
MAX_STEPS_BETWEEN_VOTES = 200


def steps_between_votes(slowest_step_seconds: float) -> int:
    """Steps to the next vote for steps of `slowest_step_seconds` (unknown yet when <= 0: 1)."""
    if slowest_step_seconds <= 0:
        return 1
    return max(1, min(MAX_STEPS_BETWEEN_VOTES, int(VOTE_INTERVAL_S / slowest_step_seconds)))


class DrainRequested(Exception):
    """A rank got SIGTERM: the group stopped at a step boundary after its final snapshot.

    Raised by `Trainer.fit()` on every rank. Exit non-zero when you catch it (see module docs).
    """


class DrainSignal:
    """SIGTERM as a flag, and the group-wide agreement on it at step boundaries."""

    def __init__(self, device: torch.device):
        self.device = device
        self.requested_at: float | None = None  # time.monotonic() of the first SIGTERM
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._voted_at: float | None = None  # time.monotonic() of this rank's last vote
        self._steps_between = 1  # steps from the last vote to the next one (the same on every rank)
        self._steps_until_vote = 1
        # Set by the run when the group may be re-formed in process: the vote is waited for through
        # it, so that a vote left waiting in a replaced group fails (training/in_process.py).
        self.guard_vote: Callable[[torch.futures.Future], torch.futures.Future] | None = None

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def _on_sigterm(self, signum: int, frame: object) -> None:
        # Runs in the main thread between bytecodes: only record, act at the next step boundary.
        if self.requested_at is None:
            self.requested_at = time.monotonic()

    @contextlib.contextmanager
    def sigterm_handler_restored(self) -> Iterator[None]:
        """On exit, put back the SIGTERM handler the process had on entry, whatever `catch_sigterm`
        installed within (main thread only)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.getsignal(signal.SIGTERM)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def catch_sigterm(self) -> None:
        """From now on SIGTERM sets the flag instead of ending the process; call it inside
        `sigterm_handler_restored` (main thread only: elsewhere one warning, and SIGTERM ends the
        process without a final snapshot)."""
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not in the main thread: SIGTERM will end this process without a final snapshot")
            return
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def agreed(self) -> bool:
        """Whether any rank had asked to drain by the previous vote. Call it at every step boundary
        on every rank, in the same order as the other collectives: on the boundaries where the ranks
        vote (the same ones on every rank), it reads one collective and starts the next."""
        if not dist.is_initialized():
            return self.requested
        self._steps_until_vote -= 1
        if self._steps_until_vote > 0:
            return False
        now = time.monotonic()
        step_seconds = (now - self._voted_at) / self._steps_between if self._voted_at is not None else 0.0
        agreed, self._steps_between = False, 1
        if self._pending is not None:
            work, votes = self._pending
            self._wait(work)
            requested, slowest_step_seconds = votes.tolist()
            agreed, self._steps_between = requested > 0, steps_between_votes(slowest_step_seconds)
        votes = torch.tensor([1.0 if self.requested else 0.0, step_seconds], dtype=torch.float64, device=self.device)
        self._pending = (dist.all_reduce(votes, op=dist.ReduceOp.MAX, async_op=True), votes)
        self._voted_at, self._steps_until_vote = now, self._steps_between
        return agreed

    def finish(self) -> None:
        """Complete the vote in flight (every rank calls this once its last step is done)."""
        if self._pending is not None:
            work, _ = self._pending
            self._pending = None
            self._wait(work)

    def _wait(self, work: dist.Work) -> None:
        if self.guard_vote is None:
            work.wait()
        else:
            self.guard_vote(work.get_future()).wait()

    def forget_vote(self) -> None:
        """Drop the vote in flight without waiting for it: its group broke (an in-process re-form);
        the next boundary votes afresh in the new group, with this rank's request, if any."""
        self._pending, self._voted_at = None, None
        self._steps_between = self._steps_until_vote = 1

    def redeliver_unused(self) -> None:
        """Raise again a SIGTERM that started no drain because the last step came first.

        Call it once `sigterm_handler_restored` has put the previous handler back and the run's work is
        done. The signal asked this process to end (torchrun sends it when it stops a worker group
        for a restart or a join); the drain only deferred it to a step boundary. With the default
        handler the process ends here; a handler the caller had installed runs, as it would have.
        Without this a worker SIGTERMed during its last steps outlived the signal: a callable worker
        (torchrun's `--run-path`) then waits for its agent to collect its result while the agent
        waits for it to exit, until the agent's shutdown timeout (30 s) SIGKILLs it.
        """
        if self.requested:
            logger.warning("SIGTERM arrived as training finished: acting on it now")
            signal.raise_signal(signal.SIGTERM)

    def seconds_since_request(self) -> float | None:
        return None if self.requested_at is None else round(time.monotonic() - self.requested_at, 3)
