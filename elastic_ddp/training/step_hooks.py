"""Hooks the trainer calls after every committed step: `hook(trainer)`, on every rank.

An exception from a hook ends `fit()` as a crash would (the last committed step is kept).
"""

from __future__ import annotations

import time
from typing import Any


class MinimumStepTime:
    """`--min_step_time_s`: sleep so that steps are at least this far apart.

    For tests and demonstrations that must see a fault happen mid-run whatever the machine's speed;
    it paces the loop, not the maths (the trajectory is the same with or without it).
    """

    def __init__(self, seconds: float):
        if not seconds > 0:
            raise ValueError(f"--min_step_time_s: got {seconds}; expected a positive number of seconds")
        self.seconds = seconds
        self._last_step_ended: float | None = None

    def __call__(self, trainer: Any) -> None:
        now = time.monotonic()
        if self._last_step_ended is not None:
            time.sleep(max(0.0, self._last_step_ended + self.seconds - now))
        self._last_step_ended = time.monotonic()
