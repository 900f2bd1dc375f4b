"""What one worker group tells about itself, in one object: the trainer's only way out.

`RunLog` gathers the event log (rank 0), this rank's audit lines (`--audit_log`), progress on
rank 0 (a bar or log lines), TensorBoard scalars (`--tensorboard_dir`), the live metrics (rank 0,
`--metrics_port`: fed every event the log writes), the `[rank/world step N]` log prefix and the
start-up timeline. The trainer calls one method per thing that happened
(`started`, `restored`, `step_committed`, ...) and never touches the pieces. It also owns the
progress windows: the loss and throughput of every --log_interval steps, reduced over all ranks
without making training wait (loss_window.py).

A committed step is reported as counted (its audit line, its `step` event and an `epoch_end` it
brings) only when the snapshot session says it counts (`steps_counted`): under `--sharding fsdp`
with memory copies, once its parts are on two nodes, a step after its commit.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog import schema
from elastic_ddp.runlog.audit import AuditLog
from elastic_ddp.runlog.events import EventLog, default_event_log
from elastic_ddp.runlog.metrics_node import metrics_directory
from elastic_ddp.runlog.progress import ProgressReporter, source_text
from elastic_ddp.runlog.reader import next_round, previous_incarnation, work_lost
from elastic_ddp.runlog.startup import StartupTimeline
from elastic_ddp.runlog.tensorboard import TensorBoardScalars, open_scalars
from elastic_ddp.runlog.worker_logging import RankPrefix
from elastic_ddp.runtime.distributed import DistributedContext, agent_pid
from elastic_ddp.snapshot.exchange.restore_agreement import RestoredSnapshot
from elastic_ddp.training.evaluation import EvalResult
from elastic_ddp.training.loss_window import LossWindow, WindowReport
from elastic_ddp.training.stragglers import StragglerReport
from elastic_ddp.workload.sampler import StepPlan

if TYPE_CHECKING:
    from elastic_ddp.runlog.metrics import RunMetrics  # prometheus_client: only with --metrics_port

logger = logging.getLogger(__name__)


class RunLog:
    """Everything one incarnation reports (see the module docstring). Close it when done."""

    def __init__(self, config: TrainingConfig, context: DistributedContext, incarnation: int,
                 steps_per_epoch: int, startup: StartupTimeline, log_prefix: RankPrefix | None = None):
        self.config = config
        self.context = context
        self.incarnation = incarnation
        self.startup = startup
        self.log_prefix = log_prefix
        event_log = config.event_log or default_event_log(config.checkpoint_dir)
        self.metrics = live_metrics(config, context, event_log, incarnation, steps_per_epoch)
        self.events = EventLog(event_log, incarnation, enabled=context.is_main,
                               sink=self.metrics.record if self.metrics is not None else None)
        self.audit = (AuditLog(config.audit_log, incarnation, context.rank, context.world_size)
                      if config.audit_log else None)
        self.progress = ProgressReporter(config.progress, config.epochs, steps_per_epoch, enabled=context.is_main)
        self.scalars: TensorBoardScalars | None = None
        self.window = LossWindow(context.device)
        self._uncounted: collections.deque[_Committed] = collections.deque()  # committed, not yet counted
        self._last_counted: _Committed | None = None
        self._counting = threading.Lock()  # steps_counted: the training thread, and the watchdog's (StopGuard.keep)

    # ------------------------------------------------------------------------------ lifecycle

    def started(self, in_process: bool = False) -> None:
        """The `start` event: rendezvous round, world, and where every rank runs (a collective);
        `in_process`: the group was re-formed by workers that kept their processes."""
        ctx = self.context
        mine = {"rank": ctx.rank, "host": socket.gethostname(), "pid": os.getpid(), "agent_pid": agent_pid(),
                "group_rank": int(os.environ.get("GROUP_RANK", "0")), "local_rank": ctx.local_rank}
        ranks: list[Any] = [mine]
        if ctx.in_process_group:
            ranks = [None] * ctx.world_size
            dist.all_gather_object(ranks, mine)
        self.events.emit(schema.START, round=next_round(self.events.path) if ctx.is_main else None,
                         world_size=ctx.world_size, local_world_size=ctx.local_world_size,
                         nodes=len({(r["host"], r["agent_pid"]) for r in ranks}), ranks=ranks,
                         restart_count=ctx.restart_count, run_id=ctx.run_id, in_process=in_process)

    def restored(self, restored: RestoredSnapshot | None) -> None:
        """What the restore found: the `restore` event and its one-line announcement (rank 0)."""
        self.startup.mark("restored")
        step = restored.snapshot.global_step if restored is not None else 0
        self._set_step(step)
        if self.context.is_main:
            self.scalars = open_scalars(self.config.tensorboard_dir, resumed_from_step=step)
        if restored is None:
            return
        snapshot = restored.snapshot
        self._resumed(snapshot.global_step, snapshot.epoch, snapshot.samples_consumed, snapshot.world_size,
                      checksum=restored.checksum, verified=True, source=restored.source,
                      source_rank=restored.source_rank, source_host=restored.source_host,
                      file=restored.entry.file if restored.entry else None, refused=restored.refused)

    def resumed_live(self, global_step: int, epoch: int, samples_consumed: int, previous_world_size: int) -> None:
        """The `restore` event of a group re-formed in process whose ranks all held the same committed
        step: nothing was loaded (`source: live`, no checksum: the state never left their memory)."""
        self.startup.mark("restored")
        self._set_step(global_step)
        if self.context.is_main:
            self.scalars = open_scalars(self.config.tensorboard_dir, resumed_from_step=global_step)
        self._resumed(global_step, epoch, samples_consumed, previous_world_size, checksum=None, verified=False,
                      source="live", source_rank=None, source_host=None, file=None, refused=[])

    def _resumed(self, global_step: int, epoch: int, samples_consumed: int, previous_world_size: int,
                 **where: Any) -> None:
        lost = work_lost(self.events.path, global_step) if self.context.is_main else None
        lost_steps, lost_seconds = lost if lost is not None else (None, None)
        self.events.emit(schema.RESTORE, global_step=global_step, epoch=epoch, samples_consumed=samples_consumed,
                         previous_world_size=previous_world_size, world_size=self.context.world_size,
                         lost_steps=lost_steps, lost_seconds=lost_seconds, **where)
        self.progress.announce_restore(self.events.path, self.incarnation, global_step, epoch, previous_world_size,
                                       self.context.world_size, lost_steps, lost_seconds,
                                       source=source_text(where["source"], where["source_rank"], where["source_host"]))

    def finished(self, global_step: int, seconds: float) -> None:
        self.events.emit(schema.FINISHED, global_step=global_step, seconds=round(seconds, 3))
        logger.info("finished: %d epochs, step %d; snapshots in %s", self.config.epochs, global_step,
                    self.config.checkpoint_dir)

    def drained(self, global_step: int, durable: bool | None, seconds_since_signal: float | None) -> None:
        self.events.emit(schema.DRAIN, global_step=global_step, snapshot_durable=durable,
                         seconds_since_signal=seconds_since_signal)
        # A worker cannot tell why torchrun sent SIGTERM: it re-forms the group (a node joined or
        # left) or this node is leaving. Neither is an error.
        logger.info("SIGTERM from torchrun (the worker group is re-formed, or this node leaves): stopped at step %d; "
                    "final snapshot durable: %s", global_step,
                    "yes" if durable else "see rank 0" if durable is None else "NO")

    def stopped_early(self, reason: str) -> None:
        """Training stopped before its end (`reason`; call `steps_counted` first); the audit log gets
        every rank's share of the last step that counted (`record_every_ranks_share`)."""
        last = self._last_counted
        logger.info("training stopped at step %s (the last that counts): %s", last and last.global_step, reason)
        self.record_every_ranks_share()

    def record_every_ranks_share(self) -> None:
        """The audit log gets every rank's share of the last step that counted here: a finished
        gradient all-reduce means every rank trained its share, and a rank that died right after
        cannot write its line (docs/failure-semantics.md). On every way this group ends: a stop,
        and an in-process re-form."""
        last = self._last_counted
        if self.audit is not None and last is not None:
            world_size = self.context.world_size
            for rank in range(world_size):
                if rank != self.context.rank:
                    self.audit.record_step_for(rank, last.plan.epoch, last.global_step,
                                               last.plan.samples_of(rank, world_size))

    def heartbeat_gap(self, seconds: float) -> None:
        """The peer watchdog saw a new longest heartbeat gap (from its thread; live metrics on rank 0)."""
        if self.metrics is not None:
            self.metrics.heartbeat_gap(seconds)

    def peer_evicted(self) -> None:
        """The peer watchdog found a peer silent: the group is re-formed without it (from its thread)."""
        if self.metrics is not None:
            self.metrics.peer_evicted()

    def straggler(self, report: StragglerReport, named: bool) -> None:
        """Rank 0's straggler judge named a rank slow, or found it back to speed (from the watchdog's thread)."""
        state = "named" if named else "recovered"
        where = "" if report.node is None else f" on node {report.node}"
        (logger.warning if named else logger.info)(
            "straggler: rank %d%s %s: %.2f of the fastest rank's speed (%.3g s of its own time per sample, the "
            "fastest %.3g s)", report.rank, where, "is slow" if named else "is back to speed", report.score,
            report.pace_seconds, report.best_pace_seconds)
        self.events.emit(schema.STRAGGLER, state=state, rank=report.rank, node=report.node,
                         score=round(report.score, 4), own_score=round(report.own_score, 4),
                         pace_seconds=report.pace_seconds, best_pace_seconds=report.best_pace_seconds)

    def rank_speeds(self, scores: dict[int, float]) -> None:
        """Rank 0 scored every rank's speed (from the watchdog's thread; live metrics)."""
        if self.metrics is not None and scores:
            self.metrics.rank_speeds(min(scores.values()))

    def close(self) -> None:
        for close in (self.audit.close if self.audit else None, self.progress.close,
                      self.scalars.close if self.scalars else None, self.events.close):
            if close is not None:
                close()

    # ------------------------------------------------------------------------------- training

    def epoch_started(self, epoch: int, steps_done: int) -> None:
        self.progress.start_epoch(epoch, steps_done=steps_done)
        self.window = LossWindow(self.context.device)

    def step_committed(self, plan: StepPlan, global_step: int, loss_sum: torch.Tensor, lr: float) -> None:
        """One optimizer step is committed: the progress window (`loss_sum` over this rank's
        samples; a collective every --log_interval steps, so every rank calls it after every step)
        and the progress bar now; its audit line and `step` event once it counts (`steps_counted`)."""
        self._set_step(global_step)
        self.window.add(loss_sum, len(plan.rank_samples), plan.global_samples)
        closing = global_step % self.config.log_interval == 0
        # The window closed a step or more ago, once reduced (in practice it is: this step's
        # gradient all-reduce came after it). Before closing the next one, wait for it rather than
        # drop it: every closed window is reported.
        self._report(self.window.take_report(wait=closing))
        if closing:
            self.window.close(global_step, plan.epoch, lr, self.context.in_process_group)
        self.progress.advance()
        self._uncounted.append(_Committed(plan, global_step))

    def steps_counted(self, through: int) -> None:
        """The committed steps up to `through` count (the snapshot session's `counted_step`): each
        one's audit line, `step` event and, if it ended an epoch, `epoch_end` event, in order. No
        collective. Thread-safe."""
        with self._counting:
            while self._uncounted and self._uncounted[0].global_step <= through:
                counted = self._last_counted = self._uncounted.popleft()
                if self.audit is not None:
                    self.audit.record_step(counted.plan.epoch, counted.global_step, counted.plan.rank_samples)
                self.events.emit(schema.STEP, global_step=counted.global_step, epoch=counted.plan.epoch)
                if counted.ends_epoch:
                    self.events.emit(schema.EPOCH_END, epoch=counted.plan.epoch, global_step=counted.global_step)
                if "first_step" not in self.startup.marks:
                    self.startup.mark("first_step")
                    self.events.emit(schema.STARTUP, global_step=counted.global_step,
                                     process_started=self.startup.process_started, seconds=self.startup.marks)

    def amp_step_skipped(self, global_step: int, scale: float) -> None:
        """GradScaler skipped step `global_step`'s update and lowered its scale to `scale` (rank 0 writes it)."""
        if self.context.is_main:
            logger.info("step %d: fp16 gradients overflowed; update skipped, loss scale now %g", global_step, scale)
        self.events.emit(schema.AMP_STEP_SKIPPED, global_step=global_step, scale=scale)

    def epoch_ended(self, epoch: int, global_step: int) -> None:
        """The step just committed (`step_committed`) ended `epoch`; its `epoch_end` event follows
        its `step` event once it counts."""
        self._report(self.window.finish())  # the epoch's last window, before its summary line
        self.progress.end_epoch()
        assert self._uncounted and self._uncounted[-1].global_step == global_step, "epoch_ended before step_committed"
        self._uncounted[-1].ends_epoch = True

    def evaluated(self, global_step: int, epoch: int, result: EvalResult) -> None:
        """An evaluation on the held-out set (rank 0 writes it): a log line, an `eval` event, scalars."""
        if not self.context.is_main:
            return
        accuracy = f", accuracy {result.accuracy:.4f}" if result.accuracy is not None else ""
        logger.info("eval at step %d (epoch %d): held-out loss %.4f%s over %d samples", global_step, epoch + 1,
                    result.loss, accuracy, result.samples)
        self.events.emit(schema.EVAL, global_step=global_step, epoch=epoch, loss=result.loss,
                         accuracy=result.accuracy, samples=result.samples)
        if self.scalars is not None:
            values = {"eval_loss": result.loss}
            if result.accuracy is not None:
                values["eval_accuracy"] = result.accuracy
            self.scalars.add(global_step, time.time(), **values)

    def report_progress(self, global_step: int, epoch: int, loss: float, lr: float, samples_per_second: float) -> None:
        """The numbers of the last --log_interval steps, already reduced over all ranks."""
        world_size = self.context.world_size
        self.progress.report(global_step, epoch, loss, lr, samples_per_second, world_size)
        self.events.emit(schema.PROGRESS, global_step=global_step, epoch=epoch, loss=loss, lr=lr,
                         samples_per_second=round(samples_per_second, 1), world_size=world_size)
        if self.scalars is not None:
            self.scalars.add(global_step, time.time(), loss=loss, lr=lr, samples_per_second=samples_per_second,
                             world_size=world_size)

    def training_interrupted(self, wait_at_most: timedelta | None = None) -> None:
        """Training stopped: report the window whose reduce is in flight. Without `wait_at_most`
        only one already reduced, never waiting (the group may be broken: its reduce came before
        the failed step's collectives); with it, waiting at most that long (the group is re-formed
        at a step boundary while it works, a join: every rank closed the window, so it completes
        unless a peer is lost meanwhile). A window not reduced by then is dropped."""
        with contextlib.suppress(Exception):
            self._report(self.window.take_report(wait=wait_at_most is not None, timeout=wait_at_most))

    def _report(self, report: WindowReport | None) -> None:
        if report is not None:
            self.report_progress(report.global_step, report.epoch, report.loss, report.lr, report.samples_per_second)

    def _set_step(self, global_step: int) -> None:
        if self.log_prefix is not None:
            self.log_prefix.step = global_step


@dataclass
class _Committed:
    """A committed step, as reported once it counts."""

    plan: StepPlan
    global_step: int
    ends_epoch: bool = False


def live_metrics(config: TrainingConfig, context: DistributedContext, event_log: Path, incarnation: int,
                 steps_per_epoch: int) -> RunMetrics | None:
    """On rank 0 with --metrics_port: what feeds its node's metrics endpoint (runlog/metrics.py), told
    every event and the peer watchdog's figures."""
    if config.metrics_port is None or not context.is_main:
        return None
    from elastic_ddp.runlog.metrics import open_node_metrics  # prometheus_client: only with --metrics_port
    from elastic_ddp.runlog.metrics_causes import how_it_ended

    every = config.snapshot_every_steps  # None: on the overhead budget, told by snapshot_cadence events
    interval = None if every is None else min(every, steps_per_epoch) if every else steps_per_epoch
    return open_node_metrics(metrics_directory(config.memory_dir, context.run_id, config.checkpoint_dir),
                             interval, previous_incarnation(event_log, incarnation),
                             previous_end=how_it_ended(event_log, incarnation),
                             watchdog_bound_s=config.watchdog_timeout_s if context.in_process_group else 0)
