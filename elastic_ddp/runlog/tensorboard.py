"""Optional TensorBoard scalars from rank 0: loss, learning rate, throughput, world size, and the
held-out loss and accuracy.

    python -m elastic_ddp.train ... --tensorboard_dir runs/job1/tb
    tensorboard --logdir runs/job1/tb

Tags (TAGS): `train/loss`, `train/lr`, `train/samples_per_second` and `cluster/world_size` every
--log_interval steps; `eval/loss` and `eval/accuracy` after each evaluation on --eval_dataset
(`eval/accuracy` only when the evaluation has one). All at the global step, next to the JSON-lines
event log (which is always written and holds more). Needs the `tensorboard` package (`pip install
'elastic_ddp[tensorboard]'`); when it is missing, `open_scalars` logs one warning and training
goes on without scalars.

After a restore, the writer opens with `purge_step` = the restored step + 1, so TensorBoard hides
the points of the steps that were rolled back and redone: each curve shows the surviving
trajectory. Not guaranteed: points of the last few seconds before a SIGKILL (the writer flushes
every FLUSH_SECONDS). A directory that cannot be written is warned about, like a missing package.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 10
TAGS = {"loss": "train/loss", "lr": "train/lr", "samples_per_second": "train/samples_per_second",
        "world_size": "cluster/world_size", "eval_loss": "eval/loss", "eval_accuracy": "eval/accuracy"}


class TensorBoardScalars:
    """A thin wrapper over torch's SummaryWriter that writes the scalars of a progress or eval event."""

    def __init__(self, writer: Any):
        self._writer = writer

    def add(self, global_step: int, wall_time: float, **values: float) -> None:
        """Write `values` (keys of TAGS) at `global_step`."""
        for name, value in values.items():
            self._writer.add_scalar(TAGS[name], value, global_step=global_step, walltime=wall_time)

    def close(self) -> None:
        self._writer.close()


def open_scalars(directory: str | Path | None, resumed_from_step: int) -> TensorBoardScalars | None:
    """A writer into `directory`, or None when none was asked for or tensorboard is not installed."""
    if not directory:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch.utils.tensorboard raises it when the tensorboard package is missing
        logger.warning("--tensorboard_dir %s: the tensorboard package is not installed (pip install "
                       "'elastic_ddp[tensorboard]'); no scalars are written, the event log still is", directory)
        return None
    purge_step = resumed_from_step + 1 if resumed_from_step else None
    try:
        writer = SummaryWriter(log_dir=str(directory), purge_step=purge_step, flush_secs=FLUSH_SECONDS)
    except OSError as exc:  # scalars are worth a warning, never a crashed (and restarted) job
        logger.warning("--tensorboard_dir %s: cannot be written (%s); no scalars are written", directory,
                       exc.strerror or exc)
        return None
    return TensorBoardScalars(writer)
