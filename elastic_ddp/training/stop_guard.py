"""When training stops before its end: keep the last committed step, whoever stops it.

Three things end a worker's training early: an exception (a collective failed because a peer died,
the collective timeout, a bug), a drain (SIGTERM: torchrun re-forms the group, or the node leaves),
and the peer watchdog (a peer sent no heartbeat within the bound). Each keeps the same thing, the
state of the last step this rank committed: in node memory (`SnapshotSession.keep_in_memory`), and
in the audit log, the shares of every rank of the last step that counts (`RunLog.stopped_early`: a
rank that died right after the all-reduce never wrote its own). Under `--sharding fsdp` with memory
copies a step counts once its parts are on two nodes, a step after its commit (the snapshot
session's `counted_step`); a drain waits for that first. docs/failure-semantics.md, "What a
failure costs".

A worker that re-forms in process (in_process.py) takes a silent peer there too, when the store
answered the read that found it silent (this node is not the one cut off: one that is could not
get a round from its agent, and must end to rejoin once its link is back) and its training thread
waits in a collective that the re-form can end: the watchdog's thread asks the agent for a round
without the peer (`in_process`, the run's, which says whether it did), and that collective fails
once the round is announced. If the training thread has not begun its re-form
SILENT_PEER_REFORM_WAIT_S later, the watchdog's way out below is taken after all.

The watchdog's way out is bounded whatever the training thread is blocked in: it copies the state
only if the training thread leaves its commit within COMMIT_WAIT_S and the device finishes that
step's work within as long again (under NCCL either can wait for ever on the all-reduce of a silent
peer), reading it through a CUDA stream of its own; else it keeps nothing, says so
(`memory_copy_failed`), and ends the worker, and the restart takes the other ranks' copies or the
snapshot files. A copy the training thread is writing itself is let finish, up to KEEPING_WAIT_S.

`StopGuard` is what the trainer uses for that:

    guard = StopGuard(state, run_log, snapshots, context, drain, epochs, watchdog_timeout_s, in_process)
    with guard.watching_peers(incarnation):     # the watchdog, for the whole worker group's life
        ...
        with guard.keeping_the_last_step():     # any exception out of training keeps it
            guard.drain_if_agreed()             # at each step boundary: SIGTERM -> final snapshot, stop
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator

from elastic_ddp.handoff.verdicts import worker_verdict_address
from elastic_ddp.runlog.metrics_causes import WATCHDOG_REASON
from elastic_ddp.runtime.distributed import DistributedContext, end_worker_now
from elastic_ddp.runtime.drain import DrainRequested, DrainSignal
from elastic_ddp.runtime.watchdog import SILENT_PEER_EXIT_CODE, PeerWatchdog
from elastic_ddp.snapshot.manager import SnapshotSession
from elastic_ddp.snapshot.training_state import TrainingState
from elastic_ddp.training.in_process import ROUND_WAIT_S
from elastic_ddp.training.reporting import RunLog

logger = logging.getLogger(__name__)


class GroupReformed(Exception):
    """The group was re-formed in process (training/in_process.py): its incarnation closes (log,
    snapshots, watchdog) while training goes on in the next one; nothing is kept, nothing stops."""

# How long the watchdog waits for the training thread before it ends the worker: to leave a commit
# (a CPU commit takes milliseconds; under NCCL one can wait for ever on an all-reduce that a silent
# peer never finishes), and to finish a memory copy it is writing itself (at 1-2 GB/s; letting it
# finish is what keeps the step).
COMMIT_WAIT_S = 1.0
KEEPING_WAIT_S = 60.0
# How long a worker that handed a silent peer to an in-process re-form waits for its training thread
# to begin it: the agent's answer (Regroup's own bound for it), then the alarm's poll.
SILENT_PEER_REFORM_WAIT_S = ROUND_WAIT_S + 2.0


class StopGuard:
    """Keeps the last committed step of one worker group's training (see the module docstring)."""

    def __init__(self, state: TrainingState, run_log: RunLog, snapshots: SnapshotSession,
                 context: DistributedContext, drain: DrainSignal, epochs: int, watchdog_timeout_s: float,
                 in_process: Callable[[str], bool] | None = None,
                 peer_switched: Callable[[int], None] | None = None):
        """`in_process(reason)`, from the watchdog's thread: whether the worker re-forms without the
        silent peer in process (it asked its agent for the round); None: it never does.
        `peer_switched(step)`, from the same thread: a peer left the group for the agent's next
        round after that committed step (`stop_watching(switched_after=)` on its side)."""
        self.state, self.run_log, self.snapshots = state, run_log, snapshots
        self.context = context
        self.drain = drain
        self.epochs = epochs
        self.watchdog_timeout_s = watchdog_timeout_s if context.in_process_group else 0
        self.in_process = in_process
        self.peer_switched = peer_switched
        self._switch_lock = threading.Lock()  # no `peer_switched` call once `stop_watching` returned
        self._watching = True
        self._kept_step: int | None = None
        self._lock = threading.Lock()  # the main thread and the watchdog's may both stop training
        self._watchdog: PeerWatchdog | None = None
        self._way_out: threading.Timer | None = None  # after a silent peer was handed to an in-process re-form

    def keep(self, reason: str, commit_wait_s: float | None = None, after_silence: bool = False) -> None:
        """Keep the last committed step now (audit shares, memory copy); once per step.

        `commit_wait_s` bounds the wait for the training thread to leave a commit (None: no bound,
        for the training thread itself, which is never inside one when it calls this). A call with a
        bound also waits at most KEEPING_WAIT_S for a copy another thread is keeping.
        `after_silence`: a peer has been silent for the watchdog's timeout, so an exchange of parts
        in flight (sharded) that could end has ended: none is waited for.
        """
        if not self._lock.acquire(timeout=-1 if commit_wait_s is None else KEEPING_WAIT_S):
            logger.error("%s: another thread has been keeping step %d for over %.0f s; not waiting longer",
                         reason, self.state.global_step, KEEPING_WAIT_S)
            return
        try:
            if self._kept_step == self.state.global_step:
                return
            self.snapshots.keep_in_memory(self.state, reason, wait_s=commit_wait_s, after_silence=after_silence)
            self.run_log.steps_counted(self.snapshots.counted_step(self.state))  # a sharded step may count now
            self.run_log.stopped_early(reason)
            self._kept_step = self.state.global_step
        finally:
            self._lock.release()

    def drain_if_agreed(self) -> None:
        """At a step boundary, on every rank: if any rank got SIGTERM (see runtime/drain.py), stop
        here: keep the step, make a final snapshot durable and replicated, raise DrainRequested."""
        if not self.drain.agreed() or self.state.sampler.epoch >= self.epochs:
            return  # (a run whose last step is done simply finishes)
        self.snapshots.wait_until_counted()  # the last committed step counts before it is kept
        self.keep("drain")  # first: fast, and kept if SIGKILL comes during the snapshot write
        self.snapshots.save(self.state, final=True)
        self.drain.finish()
        durable = self.snapshots.finish()  # a drained rank 0 takes its disk along: replicate first
        self.run_log.drained(self.state.global_step, durable, self.drain.seconds_since_request())
        raise DrainRequested(f"stopped on SIGTERM at step {self.state.global_step}")

    @contextlib.contextmanager
    def keeping_the_last_step(self) -> Iterator[None]:
        """Whatever exception leaves the block, keep the last committed step, then re-raise; but
        `GroupReformed`, which stops nothing."""
        try:
            yield
        except GroupReformed:
            raise
        except BaseException as exc:
            self.keep("drain" if isinstance(exc, DrainRequested) else f"{type(exc).__name__}: {exc}"[:300])
            raise

    @contextlib.contextmanager
    def watching_peers(self, incarnation: int, pace: Callable[[], float | None] | None = None,
                       on_paces: Callable[[dict[int, tuple[float, int | None]]], None] | None = None
                       ) -> Iterator[None]:
        """The peer watchdog for the block (none when off, or without a process group). On the way
        out this rank is marked as left, unless it failed: then its peers must find it silent, as
        a dead one (under NCCL nothing else would tell them). Under torchrun a firing watchdog
        leaves its verdict for this node's agent (`elastic_ddp.handoff.verdicts`). Its heartbeats
        carry this rank's `pace` and hand every rank's to `on_paces` (training/stragglers.py)."""
        if not self.watchdog_timeout_s:
            yield
            return
        node_rank = os.environ.get("GROUP_RANK", "")
        watchdog = self._watchdog = PeerWatchdog(
            self.context.rank, self.context.world_size, incarnation, self.watchdog_timeout_s,
            on_silent=self._stop_for_silent_peer, on_gap=self.run_log.heartbeat_gap,
            node_rank=int(node_rank) if node_rank.isdigit() else None, verdict_address=worker_verdict_address(),
            on_switched=self._on_peer_switched if self.peer_switched is not None else None, pace=pace,
            on_paces=on_paces).start()
        try:
            yield
        except DrainRequested:
            self._cancel_way_out()
            watchdog.leave()
            raise
        except BaseException as exc:
            self._cancel_way_out()
            # A re-formed group's: its heartbeat thread may wait on a store that never answers (frozen).
            watchdog.stop(wait=not isinstance(exc, GroupReformed))
            raise
        self._cancel_way_out()
        watchdog.leave()

    def stop_watching(self, switched_after: int) -> None:
        """Stop the watchdog now, without waiting for its threads: this rank leaves the group for
        the agent's next round, in process, after the committed step `switched_after`, which its
        peers are told in place of its heartbeat (a peer that has not seen the round yet would
        otherwise wait in the next step's collectives for it; the re-form has a deadline of its own)."""
        self._cancel_way_out()
        with self._switch_lock:
            self._watching = False
        if self._watchdog is not None:
            self._watchdog.stop(wait=False, switched_after=switched_after)

    def _on_peer_switched(self, step: int) -> None:
        with self._switch_lock:
            if self._watching:
                self.peer_switched(step)

    def _cancel_way_out(self) -> None:
        if self._way_out is not None:
            self._way_out.cancel()

    def _stop_for_silent_peer(self, reason: str, connected: bool = False) -> None:
        """From the watchdog's thread: hand the silent peer to an in-process re-form when the worker
        can and this node is `connected` (module docstring), with the way out below as its
        deadline; else take that way out."""
        self.run_log.peer_evicted()
        if connected and self.in_process is not None and self.in_process(reason):
            late = f"{reason}, and the in-process re-form did not begin within {SILENT_PEER_REFORM_WAIT_S:g} s"
            self._way_out = threading.Timer(SILENT_PEER_REFORM_WAIT_S, self._end_for_silent_peer, (late,))
            self._way_out.daemon = True
            self._way_out.start()
            return
        self._end_for_silent_peer(reason)

    def _end_for_silent_peer(self, reason: str) -> None:
        """Keep the last committed step if it can be had without waiting on the training thread,
        then end the process (that thread may be blocked in a collective that never returns, inside
        a commit: then nothing is kept, and that is logged and emitted)."""
        self.keep(f"{WATCHDOG_REASON}: {reason}", commit_wait_s=COMMIT_WAIT_S)
        # The event log batches step lines, and the process ends without closing it.
        self.run_log.events.flush(timeout_s=COMMIT_WAIT_S)
        end_worker_now(SILENT_PEER_EXIT_CODE)
