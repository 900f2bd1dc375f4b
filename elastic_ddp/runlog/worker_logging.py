"""Worker logging: a `[rank/world step N]` prefix, routine progress from rank 0 only.

Every rank logs its own warnings and errors; only rank 0 logs at INFO, so a job of 64 ranks does
not print every line 64 times.
"""

from __future__ import annotations

import logging
import sys


class RankPrefix(logging.Filter):
    """Adds `record.prefix`; `step` is updated by the trainer as it goes."""

    def __init__(self, rank: int, world_size: int):
        super().__init__()
        self.rank, self.world_size, self.step = rank, world_size, 0

    def filter(self, record: logging.LogRecord) -> bool:
        record.prefix = f"[{self.rank}/{self.world_size} step {self.step}]"
        return True


def configure_worker_logging(rank: int, world_size: int) -> RankPrefix:
    """Route the package's logs to stderr with the rank prefix; return the prefix to update."""
    prefix = RankPrefix(rank, world_size)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(prefix)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(prefix)s %(message)s", "%H:%M:%S"))
    package_logger = logging.getLogger("elastic_ddp")
    package_logger.handlers[:] = [handler]
    package_logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    package_logger.propagate = False
    return prefix


def installed_rank_prefix() -> RankPrefix | None:
    """The prefix `configure_worker_logging` installed in this process, if it ran."""
    for handler in logging.getLogger("elastic_ddp").handlers:
        for found in handler.filters:
            if isinstance(found, RankPrefix):
                return found
    return None
