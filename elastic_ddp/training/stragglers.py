"""Stragglers: a rank that keeps going, but slowly, named within seconds.

Synchronous training runs at the pace of its slowest rank, and a fast rank that waits in a
collective for a slow one takes as long per step as the slow one. What tells them apart is the
time each spends outside its waits. `StepPace` measures it on the training thread: a step's wall
time (from the moment the loop is handed the step to the moment it is handed the next) minus the
time the rank spent inside the run's own collectives (`waiting`: the last micro-batch's backward
with its gradient all-reduce, clipping's norm, the weight sum, the drain vote, the run's work
after a commit, snapshot copies included), per sample of its share (shares differ by a sample
when the world does not divide the batch). That remainder holds reading the data, the forwards,
the backwards under `no_sync` and the loop's own work: what a throttled or busy CPU, a stopped
process, a slow device or disk makes longer. A fast rank's waits for a slow one are subtracted;
the slow rank barely waits, so its remainder is its whole, longer, step.

Each rank's own time per sample over its last `PACE_WINDOW` steps (the sums' ratio: a throttle
quota or a stop/continue cycle shows as a few long steps among short ones, which a median would
hide) travels in its peer-watchdog heartbeat
(runtime/watchdog.py): no collective and no thread of its own. Rank 0's `StragglerJudge` scores
every rank at each heartbeat read: relative to the best rank (the best pace over its pace: 1.0 is
as fast as the fastest, 0.5 half its speed) and to its own history (its best pace in this group
over its pace now). A rank whose relative score stays below `threshold` for `patience_s` is named
(`on_named`), once; it is reported recovered (`on_recovered`) once its score has stayed at or
above the threshold for `patience_s` again.

Not guaranteed: a rank slowed only in its collectives (a degraded link) is not named, the others
wait as long as it does; nor is a slowdown of every rank at once (the scores are relative), nor a
rank whose share of the steps is empty. A rank is scored once it has measured `PACE_WINDOW`
steps. On CUDA the times are the host's: a GPU slower than its peers shows only where the host
waits for it outside the run's collectives (a loss read with `.item()` each step does).
Policy: naming only; the group is not changed because of it.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

# Steps a rank's pace is taken over: enough to ride out a slow step (a garbage collection, an
# evaluation) within the judge's patience, few enough to follow a slowdown within seconds.
PACE_WINDOW = 32


class StepPace:
    """This rank's own time per sample of its share, per step (module docstring). Used by the
    training thread; `pace` may be read from any thread."""

    def __init__(self, window: int = PACE_WINDOW, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._steps: collections.deque[tuple[float, int]] = collections.deque(maxlen=window)  # (own s, samples)
        self._own_s, self._samples_in_window = 0.0, 0  # the window's sums, kept as steps come and go
        self._pace: float | None = None
        self._started: float | None = None  # when the step in progress was handed to the loop
        self._samples = 0  # its share
        self._waited = 0.0  # its seconds inside the run's collectives so far

    def step_started(self, samples: int) -> None:
        """The loop is handed a step of `samples` samples on this rank: the one before ends here."""
        now = self._clock()
        if self._started is not None and self._samples > 0:
            self._add(max(now - self._started - self._waited, 0.0), self._samples)
        self._started, self._samples, self._waited = now, samples, 0.0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a collective of the run's own: its time is not this rank's own work."""
        began = self._clock()
        try:
            yield
        finally:
            self._waited += self._clock() - began

    def reset(self) -> None:
        """A new group: the step in progress (abandoned, or the last of the old group) is not measured."""
        self._started = None

    def pace(self) -> float | None:
        """Seconds of own time per sample over the last window of steps; None until it is full."""
        return self._pace

    def _add(self, own_s: float, samples: int) -> None:
        if len(self._steps) == self._steps.maxlen:  # the oldest leaves the window as this one comes
            oldest_s, oldest_samples = self._steps[0]
            self._own_s -= oldest_s
            self._samples_in_window -= oldest_samples
        self._steps.append((own_s, samples))
        self._own_s += own_s
        self._samples_in_window += samples
        if len(self._steps) == self._steps.maxlen:
            self._pace = max(self._own_s, 0.0) / self._samples_in_window


@dataclass
class _RankRecord:
    below_since: float | None = None  # when its score went below the threshold (None: at or above it)
    above_since: float | None = None  # while named: when it came back above
    named: bool = False
    best_pace: float | None = None  # its own best in this group


@dataclass(frozen=True)
class StragglerReport:
    """What is said of a rank when it is named or recovers."""

    rank: int
    node: int | None  # its GROUP_RANK, as its heartbeat says
    score: float  # best rank's pace / its pace
    own_score: float  # its own best pace / its pace now
    pace_seconds: float  # its own time per sample now
    best_pace_seconds: float  # the best rank's


class StragglerJudge:
    """Scores the ranks of one group from their paces and names those that stay slow (module docstring)."""

    def __init__(self, threshold: float, patience_s: float, on_named: Callable[[StragglerReport], None],
                 on_recovered: Callable[[StragglerReport], None],
                 on_scores: Callable[[dict[int, float]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 < threshold < 1:
            raise ValueError(f"straggler threshold: got {threshold}; expected a score between 0 and 1")
        self.threshold, self.patience_s = threshold, patience_s
        self.on_named, self.on_recovered, self.on_scores = on_named, on_recovered, on_scores
        self._clock = clock
        self._records: dict[int, _RankRecord] = {}

    def read(self, paces: dict[int, tuple[float, int | None]]) -> None:
        """One read of every rank's (pace, node) that has one; ranks without a pace yet are skipped."""
        measured = {rank: (pace, node) for rank, (pace, node) in paces.items() if pace > 0}
        if len(measured) < 2:
            return
        best = min(pace for pace, _ in measured.values())
        now = self._clock()
        scores = {}
        for rank, (pace, node) in measured.items():
            record = self._records.setdefault(rank, _RankRecord())
            record.best_pace = pace if record.best_pace is None else min(record.best_pace, pace)
            scores[rank] = best / pace
            report = StragglerReport(rank, node, best / pace, record.best_pace / pace, pace, best)
            self._judge(record, report, now)
        if self.on_scores is not None:
            self.on_scores(scores)


    def named(self) -> list[int]:
        return sorted(rank for rank, record in self._records.items() if record.named)

    def _judge(self, record: _RankRecord, report: StragglerReport, now: float) -> None:
        if report.score < self.threshold:
            record.above_since = None
            if record.below_since is None:
                record.below_since = now
            if not record.named and now - record.below_since >= self.patience_s:
                record.named = True
                self.on_named(report)
            return
        record.below_since = None
        if record.named:
            if record.above_since is None:
                record.above_since = now
            if now - record.above_since >= self.patience_s:
                record.named, record.above_since = False, None
                self.on_recovered(report)
