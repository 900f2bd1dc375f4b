"""A torchrun worker's main around a training function: the process group, and the exit torchrun must see.

    def train(context):                 # your loop: an ElasticRun entered and stepped
        ...
    if __name__ == "__main__":
        exit_worker(run_worker(TrainingConfig.from_args(), train))

torchrun reads a worker's exit code, so how a worker ends is part of the contract:

- 0 only when training is done: torchrun closes the rendezvous for every node once a worker group
  exits 0, so a drained node (SIGTERM, `DrainRequested`) must exit `DRAIN_EXIT_CODE` instead;
- a metrics endpoint that cannot listen as asked (`--metrics_port` in use, `--metrics_addr` not of
  this machine) ends it with `BAD_INPUT_EXIT_CODE` and one line, before any process group;
- an error ends the process at once with `FAILED_EXIT_CODE`, after logging it and without tearing
  down a process group whose peer may be gone (torchrun sees the failure sooner). The run has kept
  its last committed step before the exception reached here;
- a fatal signal (a segmentation fault in a C++ extension, an abort) prints every thread's Python
  stack to stderr first (`faulthandler`), so that a worker that vanished says where it was.
"""

from __future__ import annotations

import faulthandler
import logging
from collections.abc import Callable
from datetime import timedelta

from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog.metrics_node import MetricsEndpointError, serve_node_metrics
from elastic_ddp.runlog.worker_logging import configure_worker_logging
from elastic_ddp.runtime.distributed import DistributedContext, agent_pid, exit_worker, process_group
from elastic_ddp.runtime.drain import DRAIN_EXIT_CODE, DrainRequested
from elastic_ddp.runtime.launch_costs import warn_about_launch_costs

logger = logging.getLogger(__name__)

FAILED_EXIT_CODE = 1
BAD_INPUT_EXIT_CODE = 2  # argparse's, for a value that only fails when it is used


def run_worker(config: TrainingConfig, train: Callable[[DistributedContext], None],
               context: DistributedContext | None = None) -> int:
    """Serve the node's metrics (`--metrics_port`), then run `train(context)` inside the default
    process group (`--collective_timeout_s` bounds its collectives); 0 when it returns, the exit
    codes of the module docstring otherwise. `context`: from a caller that needed it first (its
    logging configured); without, it is read from torchrun's environment and logging configured."""
    faulthandler.enable(all_threads=True)
    if context is None:
        context = DistributedContext.from_env(config.device, config.dist_backend)
        configure_worker_logging(context.rank, context.world_size)
    if context.is_main and context.is_distributed:
        warn_about_launch_costs(agent_pid())  # once per start: what a failure will cost with this command
    try:
        serve_node_metrics(config, context)  # the node's /metrics endpoint, for every group
    except MetricsEndpointError as exc:
        logger.error("%s", exc)
        return BAD_INPUT_EXIT_CODE
    with process_group(context, timedelta(seconds=config.collective_timeout_s)):
        try:
            train(context)
        except DrainRequested as exc:
            # Never exit 0 here: torchrun closes the rendezvous for every node when a group exits 0.
            logger.info("%s; exiting with %d (not 0, which would end the job)", exc, DRAIN_EXIT_CODE)
            return DRAIN_EXIT_CODE
        except Exception:
            logger.exception("training stopped by an error; exiting with %d", FAILED_EXIT_CODE)
            exit_worker(FAILED_EXIT_CODE)
    return 0
