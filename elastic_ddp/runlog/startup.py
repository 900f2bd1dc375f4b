"""Where a worker's start-up time goes: seconds from its process start to each stage.

The trainer reports them in the `startup` event after its first optimizer step, so that the
seconds of a restart can be attributed: interpreter and `import torch`, process group, building
the model and data, restoring the snapshot, the first step (`elastic-ddp report`, "Restarts").
"""

from __future__ import annotations

import time

from elastic_ddp.runtime.procfs import process_start_unix


class StartupTimeline:
    """Seconds from this process's start to each named moment of a worker's start-up."""

    def __init__(self) -> None:
        self.process_started = process_start_unix() or time.time()
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """Record that `name` is done now (the first call for a name wins)."""
        self.marks.setdefault(name, round(time.time() - self.process_started, 3))
