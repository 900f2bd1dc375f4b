"""When a session saves: the snapshot schedule that DDP and sharded sessions share.

`snapshot/cadence.py` says how rank 0 spaces snapshots (the overhead budget or
--snapshot_every_steps); `SnapshotSchedule` adds what a session needs around it: the last step
saved, a drain's `final` snapshot, and after each budgeted snapshot the small collective that makes
every rank decide the same at every step (rank 0 chooses, one broadcast) and the `snapshot_cadence`
event.
"""

from __future__ import annotations

from collections.abc import Callable

from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runtime.distributed import DistributedContext, rank_0s
from elastic_ddp.snapshot.cadence import SnapshotCadence
from elastic_ddp.snapshot.training_state import TrainingState


class SnapshotSchedule:
    """Which committed steps a session saves; every rank holds one and gets the same answers."""

    def __init__(self, cadence: SnapshotCadence, epochs: int):
        self.cadence = cadence
        self.epochs = epochs  # training is done once the sampler reaches this epoch
        self.last_saved_step: int | None = None  # the last step found due, or the one restored

    @classmethod
    def from_config(cls, config: TrainingConfig) -> SnapshotSchedule:
        """The schedule `config` asks for (--snapshot_every_steps, or the budget flags, and --epochs)."""
        return cls(SnapshotCadence(config.snapshot_every_steps, config.snapshot_budget,
                                   config.snapshot_max_interval_s), config.epochs)

    def due(self, state: TrainingState, *, epoch_ended: bool, final: bool,
            write_in_flight: Callable[[], bool] | None = None) -> bool:
        """Whether to save the step just committed in `state`: on `final` (a drain) unless that step
        is saved already, always at the end of training, else as the cadence says. Call it after
        every committed step on every rank. A step found due counts as `last_saved_step` from then
        on, whether or not its write succeeds. `write_in_flight`: asked at the cadence's probe
        (a collective: the same answer on every rank); True moves the probe (`defer_probe`)."""
        step = state.global_step
        training_done = state.sampler.epoch >= self.epochs
        if final:
            due = self.last_saved_step != step
        else:
            due = self.cadence.due(step, epoch_ended, training_done=training_done)
            if due and write_in_flight is not None and self.cadence.at_probe(training_done) \
                    and write_in_flight():
                self.cadence.defer_probe(step)
                due = False
        if due:
            self.last_saved_step = step
        return due

    def after_save(self, global_step: int, blocked_seconds: float, context: DistributedContext, events: EventLog,
                   writer_cpu_seconds: float = 0.0) -> None:
        """After the snapshot of `global_step` was taken, which blocked rank 0's training
        `blocked_seconds` (and whose write takes `writer_cpu_seconds` of the cores training runs on):
        on the budget, rank 0 chooses the step of the next one and every rank learns it (a
        collective: call it on every rank, or on none); nothing with --snapshot_every_steps."""
        cadence = self.cadence
        if not cadence.on_budget:
            return
        measured = cadence.clock_started  # read before rank 0's next_due, which may start the clock
        next_due = rank_0s(context, cadence.next_due(global_step, blocked_seconds, writer_cpu_seconds)
                           if context.is_main else 0)
        cadence.agree(next_due, probe_measured=measured)
        interval = cadence.interval
        if context.is_main and interval is not None:
            events.emit(schema.SNAPSHOT_CADENCE, global_step=global_step, every_steps=interval.every_steps,
                        interval_s=round(interval.seconds, 3), blocked_seconds=round(blocked_seconds, 4),
                        writer_cpu_seconds=round(writer_cpu_seconds, 4), budget=cadence.budget)
