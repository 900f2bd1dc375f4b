"""What torchrun runs: parse the config, build the built-in model and data, train, tear down.

    torchrun --nnodes=1:4 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:29400 \\
        --rdzv_id=demo --max_restarts=10 -m elastic_ddp.train --epochs 3 --checkpoint_dir runs/demo

Run it with plain `python -m elastic_ddp.train ...` for a single process without torchrun.
`python -m elastic_ddp.train --help` lists every flag (also in docs/configuration.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta

from elastic_ddp.config import TrainingConfig
from elastic_ddp.data import SyntheticImageDataset, random_horizontal_flip
from elastic_ddp.distributed import DistributedContext, exit_worker, process_group
from elastic_ddp.drain import DRAIN_EXIT_CODE, DrainRequested
from elastic_ddp.models import build_model
from elastic_ddp.runlog.startup import StartupTimeline
from elastic_ddp.runlog.worker_logging import configure_worker_logging
from elastic_ddp.trainer import Trainer


def main(argv: Sequence[str] | None = None, after_step: Callable[[Trainer], None] | None = None) -> int:
    """Train; 0 when every epoch is done, DRAIN_EXIT_CODE when the node was drained (SIGTERM).

    `after_step` goes to the Trainer (see its contract): for wrappers that add a hook to this run.
    """
    startup = StartupTimeline()
    startup.mark("imports")
    config = TrainingConfig.from_args(argv)
    context = DistributedContext.from_env(config.device)
    log_prefix = configure_worker_logging(context.rank, context.world_size)
    with process_group(context, timedelta(seconds=config.collective_timeout_s)):
        startup.mark("process_group")
        trainer = Trainer(
            model=build_model(config.model, config.seed),
            dataset=SyntheticImageDataset(config.dataset_size, config.seed),
            config=config,
            sample_transform=random_horizontal_flip if config.augment else None,
            context=context,
            log_prefix=log_prefix,
            startup=startup,
            after_step=after_step,
        )
        startup.mark("built")
        try:
            trainer.fit()
        except DrainRequested as exc:
            # Never exit 0 here: torchrun closes the rendezvous for every node when a group exits 0.
            logging.getLogger(__name__).info("%s; exiting with %d (not 0, which would end the job)", exc,
                                             DRAIN_EXIT_CODE)
            return DRAIN_EXIT_CODE
    return 0


if __name__ == "__main__":
    exit_worker(main())
