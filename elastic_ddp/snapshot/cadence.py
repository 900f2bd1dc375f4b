"""When a durable snapshot is due: a fixed cadence, or an overhead budget (the default).

Memory copies cover the loss of nodes (a failure costs no committed step); the durable snapshot
only guards against losing the whole job. So by default its cadence follows a budget, as
CheckFreq does: measure what a snapshot costs training and space snapshots so that this cost stays
under `--snapshot_budget` of training time (1 %), but never further apart than
`--snapshot_max_interval_s` (10 minutes):

    interval = min(cost / budget, max interval)      every = interval / seconds per step
                                                     (rounded up to stay under the budget)

The cost is what a snapshot blocks the training thread (the RNG gather, waiting for the previous
write, the copy into staging: the `blocked_seconds` of `snapshot_captured`), plus, on a machine with
no core to spare for it, the CPU time of the background write (serialising, hashing, writing: the
writer's thread takes it from training's cores).

The first snapshot of each worker group comes `PROBE_STEPS` steps after it starts (to measure the
cost); while rank 0's write of an earlier snapshot still runs then (the one an in-process re-form
takes at once, or a restored state's), the probe moves `PROBE_STEPS` later instead of waiting for
it (`defer_probe`: the session agrees on it). After each snapshot rank 0 chooses when the next one
is due and broadcasts that step (one small collective per snapshot), so every rank decides the
same at every step. Epoch ends follow the budget too. The end of training is always saved, and so
is a drain (its `final` snapshot).

`--snapshot_every_steps N` overrides the budget: every N steps and at every epoch end (0: only at
epoch ends), as asked.

Not guaranteed: the budget is kept on average over an interval, measured on rank 0's training
thread; a step far slower or faster than the ones measured shifts it until the next snapshot.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PROBE_STEPS = 10  # the first snapshot of a worker group, to measure what one costs
CHANGE_WORTH_A_LOG_LINE = 2.0  # log the interval again when it moves by this factor


@dataclass(frozen=True)
class Interval:
    """A chosen spacing of budgeted snapshots."""

    every_steps: int
    seconds: float  # the steps' expected duration
    blocked_seconds: float  # what the snapshot that set it cost the training thread
    writer_cpu_seconds: float = 0.0  # and its background write's CPU, counted where it competes with training


class SnapshotCadence:
    """Decides, after every committed step, whether a snapshot is due (see the module docstring)."""

    def __init__(self, every_steps: int | None, budget: float, max_interval_s: float):
        self.every_steps = every_steps
        self.budget = budget
        self.max_interval_s = max_interval_s
        self.next_due_step: int | None = None  # on the budget: agreed by every rank
        self.interval: Interval | None = None
        self._clock: tuple[int, float] | None = None  # (step, time.monotonic()) when this group started
        self._measured = False  # a snapshot after this group's first step was taken: the probe is past (`agree`)
        self._blocked_total = 0.0  # seconds snapshots blocked training since then (rank 0)

    @property
    def on_budget(self) -> bool:
        return self.every_steps is None

    def due(self, global_step: int, epoch_ended: bool, training_done: bool) -> bool:
        """Whether the step just committed is to be saved (the same answer on every rank)."""
        if self._clock is None:  # this worker group's first step
            self._clock = (global_step, time.monotonic())
            self.next_due_step = global_step + PROBE_STEPS - 1
        if training_done:
            return True
        if not self.on_budget:
            return epoch_ended or bool(self.every_steps and global_step % self.every_steps == 0)
        return global_step >= self.next_due_step

    def at_probe(self, training_done: bool) -> bool:
        """Whether the step just found due is this group's probe on the budget, which may move."""
        return self.on_budget and not self._measured and not training_done

    def defer_probe(self, global_step: int) -> None:
        """Every rank alike: the probe found due at `global_step` moves `PROBE_STEPS` later."""
        self.next_due_step = global_step + PROBE_STEPS

    def next_due(self, global_step: int, blocked_seconds: float, writer_cpu_seconds: float = 0.0) -> int:
        """Rank 0, after saving `global_step` at a cost of `blocked_seconds` on the training thread
        and `writer_cpu_seconds` of a background write that competes with training (0 where a core
        is spare): the step the next budgeted snapshot is due at (to be agreed: see `agree`)."""
        if self._clock is None:  # saved before this group's first step (an in-process re-form): probe first
            self._clock = (global_step, time.monotonic())
            return global_step + PROBE_STEPS
        self._blocked_total += blocked_seconds
        start_step, start_time = self._clock
        steps = max(1, global_step - start_step)
        # Blocked time is not training time; the writer's CPU is already inside the steps' own.
        step_seconds = max(1e-6, (time.monotonic() - start_time - self._blocked_total) / steps)
        # Rounded so as to stay under the budget (up) and under the ceiling (down).
        budget_steps = math.ceil((blocked_seconds + writer_cpu_seconds) / self.budget / step_seconds)
        ceiling_steps = math.floor(self.max_interval_s / step_seconds)
        every = max(1, min(budget_steps, ceiling_steps))
        self._log_if_changed(Interval(every, every * step_seconds, blocked_seconds, writer_cpu_seconds))
        return global_step + every

    @property
    def clock_started(self) -> bool:
        """Whether this group has committed a step (`due` was asked since it started): the same on
        every rank until rank 0's `next_due`, which starts the clock of a group that saved first."""
        return self._clock is not None

    def agree(self, next_due_step: int, probe_measured: bool = True) -> None:
        """Every rank: the next budgeted snapshot is due at `next_due_step` (rank 0's choice).
        `probe_measured`: the snapshot just taken came after this group's first step, so it
        measured what one costs and the probe is past (`at_probe`); False for one taken before it
        (an in-process re-form's). Every rank must pass the same."""
        self.next_due_step = next_due_step
        self._measured = self._measured or probe_measured

    def _log_if_changed(self, interval: Interval) -> None:
        previous, self.interval = self.interval, interval
        if previous is not None and 1 / CHANGE_WORTH_A_LOG_LINE < interval.every_steps / previous.every_steps \
                < CHANGE_WORTH_A_LOG_LINE:
            return
        cost = interval.blocked_seconds + interval.writer_cpu_seconds
        writer = (f" and its write takes {interval.writer_cpu_seconds:.3f} s of CPU from training's cores"
                  if interval.writer_cpu_seconds else "")
        logger.info("durable snapshots every %d steps (%.0f s): one blocks training %.3f s%s, %.2f%% of the time "
                    "(--snapshot_budget %g, at most every %g s)", interval.every_steps, interval.seconds,
                    interval.blocked_seconds, writer, 100 * cost / max(interval.seconds, 1e-9),
                    self.budget, self.max_interval_s)
