"""The durable step of a sharded run whose ranks share one checkpoint directory.

    newest = on_every_rank(context, lambda: newest_step(root))                      # no file read
    durable = on_every_rank(context, lambda: newest_that_verifies(root, fingerprint))  # reads one step at best

Rank 0 looks, every rank gets its answer (a broadcast over the job's process group when there is
one). `newest_step` lists the committed directories only: no durable step is newer, which is all a
memory state needs to be weighed against. `newest_that_verifies` checks the steps newest first
(every file's size and checksum against the manifest, `.metadata` through the safe reader,
`trainer.snap` loaded and fitted to this run) and stops at the first that passes; each one refused
is logged with its reason. Two readers share it: the sharded session's restore and, outside any
job, `load_snapshot` (loading.py: any run's steps, no process group).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from elastic_ddp.runtime.distributed import DistributedContext
from elastic_ddp.snapshot.serialization import check_compatible, snapshot_from_file
from elastic_ddp.snapshot.sharded import step_directories as steps
from elastic_ddp.snapshot.sharded.safe_reader import SafeFileSystemReader

logger = logging.getLogger(__name__)

T = TypeVar("T")


def on_every_rank(context: DistributedContext, look: Callable[[], T]) -> T | None:
    """What `look()` returns on rank 0, on every rank (a collective when in a process group)."""
    answer = [look() if context.is_main else None]
    if context.in_process_group:
        dist.broadcast_object_list(answer, src=0)
    return answer[0]


def newest_step(root: Path) -> int | None:
    """The newest committed step under `root` (its directory's name only)."""
    committed = steps.committed_steps(root)
    return committed[0][0] if committed else None


def newest_that_verifies(root: Path, fingerprint: dict[str, Any] | None) -> tuple[str, str, int] | None:
    """(directory name, manifest checksum, step) of the newest committed step that verifies and fits
    `fingerprint` (None: any run's, as `load_snapshot` reads them)."""
    for step, directory in steps.committed_steps(root):
        try:
            checksum = steps.verify(directory)
            SafeFileSystemReader(directory).read_metadata()  # refuses an index that would run code
            plain, _ = snapshot_from_file(directory / steps.TRAINER_FILE, str(directory / steps.TRAINER_FILE))
            if fingerprint is not None:
                check_compatible(plain, fingerprint, str(directory))
        except Exception as exc:  # noqa: BLE001 - any reason to refuse it is a reason to try the next
            logger.warning("sharded snapshot of step %d refused: %s", step, exc)
            continue
        return directory.name, checksum, step
    return None
