"""What torchrun runs: parse the config, build the model and data, train, tear down.

    torchrun --nnodes=1:4 --nproc_per_node=2 --rdzv_backend=elastic-c10d --rdzv_endpoint=127.0.0.1:29400 \\
        --rdzv_id=demo --max_restarts=10 -m elastic_ddp.train --epochs 3 --checkpoint_dir runs/demo

Your own model and data need no script: `--model my_pkg.models:build --dataset my_pkg.data:train`
(elastic_ddp/training/workload_builder.py). To add flags of your own, subclass `TrainingConfig` and pass it as
`config_class`: `main(config_class=MyConfig)`.

Run it with plain `python -m elastic_ddp.train ...` for a single process without torchrun.
`python -m elastic_ddp.train --help` lists every flag (also in docs/configuration.md).
"""

from __future__ import annotations

if __name__ == "__main__":
    # Before any other import: under torchrun with our rendezvous, this process hands the run to a
    # warm worker forked from the agent's warm-worker server (no torch import here) and ends as it ends.
    from elastic_ddp.handoff.warm_client import become_warm_worker

    become_warm_worker("elastic_ddp.train")

import logging
from collections.abc import Callable, Sequence

from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog.startup import StartupTimeline
from elastic_ddp.runlog.worker_logging import configure_worker_logging
from elastic_ddp.runtime.distributed import DistributedContext, exit_worker
from elastic_ddp.runtime.prefetch import start_prefetching_dynamo
from elastic_ddp.training.trainer import Trainer
from elastic_ddp.training.worker_main import BAD_INPUT_EXIT_CODE, FAILED_EXIT_CODE, run_worker  # noqa: F401 - re-exported
from elastic_ddp.training.workload_builder import build_workload
from elastic_ddp.workload.user_code import UserCodeError

logger = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None, after_step: Callable[[Trainer], None] | None = None,
         config_class: type[TrainingConfig] = TrainingConfig) -> int:
    """Train; 0 when every epoch is done, DRAIN_EXIT_CODE when the node was drained (SIGTERM). An
    error in training ends the process at once with FAILED_EXIT_CODE, after logging it: this is a
    worker's main, not a library call (use `Trainer.fit` for that). A model, dataset or loss that
    cannot be built, or a metrics endpoint that cannot listen as asked (--metrics_port in use,
    --metrics_addr not of this machine), ends it with BAD_INPUT_EXIT_CODE and one line, before any
    process group.

    `after_step` goes to the Trainer (see its contract): for wrappers that add a hook to this run.
    `config_class`: a subclass of TrainingConfig whose extra fields become flags too.
    """
    startup = StartupTimeline()
    startup.mark("imports")
    start_prefetching_dynamo()  # overlaps the process group's set-up and the restore
    config = config_class.from_args(argv)
    context = DistributedContext.from_env(config.device, config.dist_backend)
    log_prefix = configure_worker_logging(context.rank, context.world_size)
    try:
        workload = build_workload(config)
    except UserCodeError as exc:
        logger.error("%s", exc)
        return BAD_INPUT_EXIT_CODE

    def train(context: DistributedContext) -> None:
        startup.mark("process_group")
        trainer = Trainer(
            model=workload.model,
            dataset=workload.dataset,
            eval_dataset=workload.eval_dataset,
            loss_fn=workload.loss_fn,
            config=config,
            sample_transform=workload.sample_transform,
            collate_fn=workload.collate_fn,
            context=context,
            log_prefix=log_prefix,
            startup=startup,
            after_step=after_step,
        )
        startup.mark("built")
        trainer.fit()

    return run_worker(config, train, context)


if __name__ == "__main__":
    exit_worker(main())
