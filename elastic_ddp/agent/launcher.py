"""`python -m elastic_ddp.agent.launcher`: torchrun, with workers that start warm and dead nodes that leave fast.

    python -m elastic_ddp.agent.launcher --nnodes=1:4 --nproc_per_node=2 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29400 --rdzv_id=job1 --max_restarts=10 -m elastic_ddp.train --epochs 10

It takes exactly torchrun's arguments and runs torchrun's own agent (launch/node.sh uses it). The
first difference is how workers start. After every failure or join, torchrun starts each worker as
a new `python -m MODULE` process, which imports torch and, at the first `torch.optim` call,
torch._dynamo: seconds per restart. Here the agent starts a multiprocessing fork server that imports
torch, torch._dynamo and elastic_ddp's trainer once, side by side with the agent's own imports and
its rendezvous (entering the rendezvous only once it is ready made a join slower in all); torchrun
then forks every worker from it (`--start-method forkserver`) and the worker runs `MODULE` with
`runpy`, as `python -m MODULE` would. Figures: docs/failure-semantics.md ("Recovery speed"),
docs/benchmarks-history.md.
Plain torchrun gets warm workers too where it can: with `--rdzv_backend=elastic-c10d` or `etcd-v3`
and `-m elastic_ddp.train`, our rendezvous plugin starts a warm-worker server in the agent
(elastic_ddp/agent/warm_workers.py) that the worker process hands its run to. This launcher turns
that server off (`ELASTIC_DDP_WARM_WORKERS=0` in its environment): its fork server does the same job,
for any `-m MODULE` and any backend.

The other difference: `--rdzv_backend=c10d` gets dead-node probes (elastic_ddp.agent.rendezvous.liveness):
a killed node leaves the rendezvous as soon as a survivor waits for it, not when its heartbeat
expires 5 s later (`--rdzv_conf=...,probe_dead_nodes=0` turns them off). The launcher does this by
running `--rdzv_backend=elastic-c10d` in its place: the keyed rendezvous in the same TCPStore
(elastic_ddp.agent.rendezvous.keyed_c10d).

Nothing else changes: restarts, signals (SIGTERM still reaches each worker),
exit codes and logs are torchrun's. The workers are the fork server's children, not the agent's:
`end_with_the_node` makes each one end as soon as its agent or its fork server does, so that a
node killed the way a plain torchrun node is (the agent and its children) leaves nothing running.
`--no-python`, `--run-path` and script paths are passed to torchrun unchanged (cold start).

Limits: the modules in `ELASTIC_DDP_PRELOAD` (comma-separated; default `PRELOAD`) are imported in
the fork server, so they must not start threads or initialise CUDA when imported (torch does
neither); your training module itself is imported in each worker, after the fork. OpenMP reads
OMP_NUM_THREADS when torch is imported, that is in the fork server: each worker therefore applies
the OMP_NUM_THREADS that torchrun gives it with `torch.set_num_threads`.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import signal
import sys
import threading
from collections.abc import Sequence

from elastic_ddp.warm_client import OFF as WARM_WORKERS_OFF
from elastic_ddp.warm_client import VARIABLE as WARM_WORKERS_VARIABLE

PRELOAD = ("torch", "torch._dynamo", "torch.optim", "elastic_ddp.training.trainer")
PRELOAD_VARIABLE = "ELASTIC_DDP_PRELOAD"
# The logger of torchrun's worker processes, which logs their failures with tracebacks.
FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def run_module(module: str, *argv: str) -> None:
    """Worker entry point: run `module` as `python -m module *argv` would, in this process."""
    end_with_the_node()
    set_torch_threads_from_environment()
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def end_with_the_node() -> None:
    """End this forked worker when its agent or its fork server ends: a lost node's workers stop.

    A forked worker is the fork server's child, not the agent's, so killing a node the way one kills
    plain torchrun's (the agent and its children) would otherwise leave it training, unseen. And
    the fork server does not end with the agent: every worker holds the pipe it watches for that.
    Two guards, both immediate:
    - a daemon thread waits on multiprocessing's parent sentinel, a pipe whose other end only the
      agent holds, and SIGKILLs this process when the agent is gone;
    - the kernel SIGKILLs it when the fork server ends (PR_SET_PDEATHSIG); if the fork server was
      already gone when this runs (the parent changed), the worker exits at once.
    """
    end_with_the_parent(os.getppid())
    agent = multiprocessing.parent_process()
    if agent is not None and agent.sentinel is not None:
        threading.Thread(target=_kill_self_when_ready, args=(agent.sentinel,), name="end-with-the-agent",
                         daemon=True).start()


def end_with_the_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent `parent_pid` ends (PR_SET_PDEATHSIG), and
    exit at once if it has already ended (the parent changed). The parent is the thread that started
    this process: start it from a thread that lives as long as the parent does (the main thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logging.getLogger(__name__).warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this process may outlive "
                                            "its parent", ctypes.get_errno())
    elif os.getppid() != parent_pid:
        os._exit(1)


def set_torch_threads_from_environment() -> None:
    """Apply the OMP_NUM_THREADS of this worker's environment to torch, which was imported before the
    fork with the environment of the process that preloaded it (OpenMP reads it at that import).
    Nothing to do when torch was not preloaded: its own import reads this environment."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def _kill_self_when_ready(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os.kill(os.getpid(), signal.SIGKILL)


def warm_arguments(argv: list[str]) -> list[str] | None:
    """torchrun arguments that run `-m MODULE` through `run_module`, or None to leave argv alone.

    `-m MODULE` becomes `--run-path MODULE` (torchrun then calls its `run_script_path`, which
    `main` points at `run_module`), and `--start-method forkserver` is added unless given.
    """
    from torch.distributed.run import parse_args

    args = parse_args(argv)
    if not args.module or args.no_python or args.run_path:
        return None
    script_at = len(argv) - len(args.training_script_args) - 1
    if argv[script_at] != args.training_script or argv[script_at - 1] not in ("-m", "--module"):
        return None  # an unusual spelling (e.g. -mMODULE): leave it to torchrun
    options = [a for a in argv[:script_at - 1]]
    if not any(a.startswith(("--start-method", "--start_method")) for a in options):
        options.append("--start-method=forkserver")
    return [*options, "--run-path", args.training_script, *args.training_script_args]


def preload_modules() -> list[str]:
    """The modules a fork server imports before it forks: `ELASTIC_DDP_PRELOAD` (comma-separated) or PRELOAD."""
    preload = os.environ.get(PRELOAD_VARIABLE)
    return [m for m in preload.split(",") if m] if preload is not None else list(PRELOAD)


def start_fork_server() -> None:
    """Start the fork server now, importing the preload modules while the rendezvous runs."""
    multiprocessing.set_forkserver_preload(preload_modules())
    multiprocessing.forkserver.ensure_running()


class TracebackAsText(logging.Filter):
    """Turn a record's traceback into text before torch's log formatter sees it.

    With callable entry points the agent logs every worker failure with `logger.exception`, and
    torch's formatter imports torch._dynamo to format any record that carries `exc_info`: seconds,
    once per agent, between a worker's failure and the agent acting on it. With the traceback
    already in `exc_text` the formatter prints the same text without that import.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            record.exc_text = record.exc_text or logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        return True


def probed_c10d_arguments(argv: list[str]) -> list[str]:
    """`argv` with torchrun's `--rdzv_backend=c10d` (or `--rdzv-backend c10d`) turned into
    `elastic-c10d`: the same store, the keyed rendezvous with dead-node probes. The training
    script's own arguments are left alone."""
    from torch.distributed.run import parse_args

    from elastic_ddp.agent.rendezvous.keyed_c10d import BACKEND_NAME

    argv = list(argv)
    script_at = len(argv) - len(parse_args(argv).training_script_args) - 1
    for index in range(script_at):
        flag, equals, value = argv[index].partition("=")
        if flag not in ("--rdzv_backend", "--rdzv-backend"):
            continue
        if equals and value == "c10d":
            argv[index] = f"{flag}={BACKEND_NAME}"
        elif not equals and index + 1 < script_at and argv[index + 1] == "c10d":
            argv[index + 1] = BACKEND_NAME
    return argv


def may_run_warm(argv: Sequence[str]) -> bool:
    """A cheap guess, before torch is imported, that `warm_arguments` will accept `argv`."""
    flags = set(argv)
    return bool(flags & {"-m", "--module"}) and not flags & {"--no-python", "--no_python", "--run-path", "--run_path"}


def local_addr_argument(argv: Sequence[str]) -> str | None:
    """The value of torchrun's `--local_addr` (`--local-addr`) among its options, those before `-m`."""
    for index, argument in enumerate(argv):
        if argument in ("-m", "--module"):
            break
        flag, equals, value = argument.partition("=")
        if flag in ("--local_addr", "--local-addr"):
            return value if equals else (argv[index + 1] if index + 1 < len(argv) else None)
    return None


def name_the_workers_interface(argv: Sequence[str]) -> None:
    """Name the interface of this node's address to the workers' gloo and NCCL now, before the fork
    server starts: forked from it, the workers keep its environment, not what our rendezvous
    backends set in the agent's later (elastic_ddp.agent.rendezvous.addresses)."""
    from elastic_ddp.agent.rendezvous.addresses import published_address, worker_interface_environment

    os.environ.update(worker_interface_environment(published_address(local_addr_argument(argv))))


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if may_run_warm(argv):
        name_the_workers_interface(argv)
        start_fork_server()  # first: it imports torch while this agent imports torch too

    from torch.distributed import run as torchrun

    argv = probed_c10d_arguments(argv)
    warm = warm_arguments(argv)
    if warm is not None:
        # torchrun's --run-path entry point, pointed at runpy.run_module instead of run_path.
        torchrun.run_script_path = run_module
        start_fork_server()
        logging.getLogger(FAILURE_LOGGER).addFilter(TracebackAsText())
        # Its workers come from the fork server: the rendezvous plugin starts no warm-worker server.
        os.environ[WARM_WORKERS_VARIABLE] = WARM_WORKERS_OFF
        argv = warm
    torchrun.main(argv)


if __name__ == "__main__":
    main()
