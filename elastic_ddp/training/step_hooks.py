"""Pacing between steps: what `ElasticRun` does at each step boundary for `--min_step_time_s`."""

from __future__ import annotations

import time


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

    def wait(self) -> None:
        """Sleep until `seconds` after the previous call ended (at once the first time)."""
        now = time.monotonic()
        if self._last_step_ended is not None:
            time.sleep(max(0.0, self._last_step_ended + self.seconds - now))
        self._last_step_ended = time.monotonic()
