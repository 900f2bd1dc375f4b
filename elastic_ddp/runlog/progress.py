"""What rank 0 tells the person watching: a progress bar per epoch, or plain log lines.

    --progress auto   a tqdm bar per epoch when rank 0's stderr is a terminal, log lines otherwise
    --progress bar    always the bar;  --progress log   always log lines;  --progress off   neither

The bar shows the epoch, steps done in it, steps per second and, refreshed every --log_interval
steps, the global step, loss, learning rate, samples per second and world size. In log mode the
same numbers come as one log line every --log_interval steps, which suits CI and log files (no
carriage returns). While a bar is open, the package's log lines are written above it.

Whatever the mode, every restore is announced in one line that says what happened, e.g.

    node lost: world 4 -> 3, resumed from step 1200 (epoch 2/10), lost 37 steps (9.8 s), 14.2 s without training

Cost: `advance()` runs once per optimizer step on rank 0 and only bumps tqdm's counter (tqdm
redraws at most every 0.1 s); on other ranks the reporter is disabled and every call returns at
once. Not guaranteed: the bar of a job whose rank 0 moves to another node after a restart moves
with it (to that node's terminal or log).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import IO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from elastic_ddp.config import PROGRESS_MODES
from elastic_ddp.runlog.reader import PreviousIncarnation, previous_incarnation

logger = logging.getLogger(__name__)

FALLBACK_SIZE = (120, 40)  # columns, rows


def resolve_mode(mode: str, stream: IO[str]) -> str:
    """`auto` becomes `bar` on a terminal and `log` anywhere else (a pipe, a file, CI)."""
    if mode not in PROGRESS_MODES:
        raise ValueError(f"--progress: got {mode!r}; expected one of {', '.join(PROGRESS_MODES)}")
    if mode != "auto":
        return mode
    isatty = getattr(stream, "isatty", None)
    return "bar" if isatty is not None and isatty() else "log"


def _terminal_columns(stream: IO[str]) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


class ProgressReporter:
    """Progress of one incarnation, shown by rank 0. Build one per `Trainer.fit()`."""

    def __init__(self, mode: str, epochs: int, steps_per_epoch: int, enabled: bool = True,
                 stream: IO[str] | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.mode = resolve_mode(mode, self.stream) if enabled else "off"
        self.enabled = enabled
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch
        self._bar: tqdm | None = None
        self._redirect = contextlib.ExitStack()
        self._epoch = 0
        self._steps_in_epoch = 0
        self._steps_this_incarnation = 0
        self._epoch_started = 0.0

    # ------------------------------------------------------------------------------ per epoch

    def start_epoch(self, epoch: int, steps_done: int) -> None:
        """Epoch `epoch` (0-based) begins, or resumes with `steps_done` of its steps already done."""
        self._epoch, self._steps_in_epoch, self._steps_this_incarnation = epoch, steps_done, 0
        self._epoch_started = time.monotonic()
        if self.mode != "bar":
            return
        # A terminal that reports no size (a bare pty, some CI runners) makes tqdm hide the bar.
        sized = _terminal_columns(self.stream) > 0
        self._bar = tqdm(total=self.steps_per_epoch, initial=steps_done, desc=f"epoch {epoch + 1}/{self.epochs}",
                         unit="step", file=self.stream, leave=True, dynamic_ncols=sized,
                         ncols=None if sized else FALLBACK_SIZE[0], nrows=None if sized else FALLBACK_SIZE[1])
        self._redirect.enter_context(logging_redirect_tqdm(loggers=[logging.getLogger("elastic_ddp")]))

    def advance(self) -> None:
        """One optimizer step done (the hot path: keep it a counter bump)."""
        self._steps_in_epoch += 1
        self._steps_this_incarnation += 1
        if self._bar is not None:
            self._bar.update(1)

    def report(self, global_step: int, epoch: int, loss: float, lr: float, samples_per_second: float,
               world_size: int) -> None:
        """The numbers of the --log_interval steps up to `global_step` of `epoch` (already reduced
        over all ranks; reported a step or so later, so the step is the report's, not the count's)."""
        if self.mode == "bar" and self._bar is not None:
            self._bar.set_postfix_str(f"step {global_step}, loss {loss:.4g}, lr {lr:.3g}, "
                                      f"{samples_per_second:,.0f} samples/s, world {world_size}", refresh=False)
        elif self.mode == "log":
            logger.info("epoch %d/%d, step %d/%d of the epoch: loss %.4g, lr %.3g, %.0f samples/s, world %d",
                        epoch + 1, self.epochs, global_step - epoch * self.steps_per_epoch, self.steps_per_epoch,
                        loss, lr, samples_per_second, world_size)

    def end_epoch(self) -> None:
        """The epoch's last step is done."""
        seconds = time.monotonic() - self._epoch_started
        self._close_bar()
        if self.mode == "log":
            logger.info("epoch %d/%d done: %d steps in %.1f s", self._epoch + 1, self.epochs,
                        self._steps_this_incarnation, seconds)

    def close(self) -> None:
        """Close an open bar (training ended or raised mid-epoch)."""
        self._close_bar()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._redirect.close()

    # ------------------------------------------------------------------------------ restores

    def announce_restore(self, event_log: str | Path, incarnation: int, restored_step: int, restored_epoch: int,
                         snapshot_world_size: int, world_size: int, lost_steps: int | None,
                         lost_seconds: float | None, source: str = "") -> str | None:
        """Log the one line that says what the restart was; return it (None on a disabled reporter)."""
        if not self.enabled:
            return None
        previous = previous_incarnation(event_log, incarnation)
        line = restore_message(previous, snapshot_world_size, world_size, restored_step, restored_epoch,
                               self.epochs, lost_steps, lost_seconds, now=time.time(), source=source)
        logger.info("%s", line)
        return line


def source_text(source: str, rank: int | None, host: str | None) -> str:
    """`memory of rank 3 on node-b`, `a snapshot file`, or `the survivors' own state` (`live`: a
    group re-formed in process): where a restore's state came from."""
    if source == "live":
        return "the survivors' own state (re-formed in process)"
    return f"memory of rank {rank} on {host}" if source == "memory" else "a snapshot file"


def restore_message(previous: PreviousIncarnation | None, snapshot_world_size: int, world_size: int,
                    restored_step: int, restored_epoch: int, epochs: int, lost_steps: int | None,
                    lost_seconds: float | None, now: float, source: str = "") -> str:
    """`node lost: world 4 -> 3, resumed from step 1200 (epoch 2/10) from memory of rank 1 on b,
    lost 0 steps (0.0 s), ...`."""
    before = previous.world_size if previous is not None and previous.world_size else snapshot_world_size
    kind = restart_kind(previous, before, world_size)
    epoch_text = f"epoch {min(restored_epoch + 1, epochs)}/{epochs}"
    line = f"{kind}: world {before} -> {world_size}, resumed from step {restored_step} ({epoch_text})"
    if source:
        line += f" from {source}"
    if lost_steps is not None and kind != "relaunched":
        line += f", lost {lost_steps} step{'' if lost_steps == 1 else 's'} ({lost_seconds or 0.0:.1f} s)"
    if previous is not None and kind != "relaunched":
        line += f", {max(0.0, now - previous.last_event_time):.1f} s without training"
    return line


def restart_kind(previous: PreviousIncarnation | None, world_size_before: int, world_size: int) -> str:
    """What a worker group's start was to the one before it (`previous`, of `world_size_before` ranks):
    `relaunched` (that one had finished), `node lost`, `node joined` or `restarted` (the same world)."""
    if previous is not None and previous.finished:
        return "relaunched"
    if world_size < world_size_before:
        return "node lost"
    if world_size > world_size_before:
        return "node joined"
    return "restarted"
