"""`python -m elastic_ddp.agent.launcher`: torchrun, with workers that start warm and dead nodes that leave fast.

    python -m elastic_ddp.agent.launcher --nnodes=1:4 --nproc_per_node=2 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29400 --rdzv_id=job1 --max_restarts=10 -m elastic_ddp.train --epochs 10

It takes exactly torchrun's arguments and runs torchrun's own agent (launch/node.sh uses it), with two
differences.

Warm workers for any `-m MODULE` and any backend. After every failure or join, torchrun starts each
worker as a new `python -m MODULE` process, which imports torch and, at the first `torch.optim`
call, torch._dynamo: seconds per restart. The launcher forks the agent's warm-worker server
(elastic_ddp/agent/warm_workers.py) as soon as it has imported torchrun (and so torch), so that it
imports the rest while the agent enters its rendezvous, and has torchrun start each worker as `python -m
elastic_ddp.handoff.warm_start MODULE ARGS...`: a thin client that hands its run to the server, which forks
the worker from its warm state and runs MODULE as `python -m MODULE ARGS...` would
(elastic_ddp/handoff/warm_client.py). Plain torchrun gets the same server from our rendezvous plugin, but
only with our backends and for the modules of `warm_client.WARM_MODULES`; under the launcher the
plugin finds the server running and starts none. The agent enters the rendezvous once its server
has its imports (at most `warm_workers.READY_WAIT_S`) when it joins a running job (the plugin's
rendezvous handler waits on the server the launcher started): a node that joins a running job would otherwise close a
round that stops the running nodes, which then wait in `init_process_group` for its workers'
imports. Figures: docs/failure-semantics.md ("Recovery speed"). `--rdzv_conf ...,warm_workers=0` or `ELASTIC_DDP_WARM_WORKERS=0` turns this off: torchrun
then gets `-m MODULE` as given.

Dead-node probes for `--rdzv_backend=c10d` (elastic_ddp.agent.rendezvous.liveness): a killed node
leaves the rendezvous as soon as a survivor waits for it, not when its heartbeat expires 5 s later
(`--rdzv_conf=...,probe_dead_nodes=0` turns them off). The launcher does this by running
`--rdzv_backend=elastic-c10d` in its place: elastic_ddp's rendezvous in the same TCPStore
(elastic_ddp.agent.rendezvous.boards.c10d).

Nothing else changes: restarts, signals, exit codes and logs are torchrun's, and the process that
torchrun starts, watches and signals for each worker is its own (the client, which ends the forked
worker with it). A node killed as one kills plain torchrun's (its agent, or the agent and its
children) leaves no forked worker running: the server ends with the agent, its children with it.
`--no-python`, `--run-path` and script paths are passed to torchrun unchanged (cold start).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence

from elastic_ddp.agent.rendezvous.plugin import WARM_WORKERS_KEY
from elastic_ddp.agent.warm_workers import start_warm_worker_server
from elastic_ddp.handoff import warm_start

# `warm_workers=0` in an `--rdzv_conf` value (`--rdzv_conf=a=1,warm_workers=0` or a separate argument).
WARM_WORKERS_OFF_CONF = re.compile(rf"(?:^|[=,]){WARM_WORKERS_KEY}=0(?:,|$)")


def may_run_warm(argv: Sequence[str]) -> bool:
    """A cheap guess, before torch is imported, that `warm_arguments` will rewrite `argv`: a module
    (`-m`), and neither `--no-python`, `--run-path` nor `warm_workers=0` among the options before `-m`."""
    flags = set(argv)
    if not flags & {"-m", "--module"} or flags & {"--no-python", "--no_python", "--run-path", "--run_path"}:
        return False
    options = argv[:min(argv.index(flag) for flag in flags & {"-m", "--module"})]
    return not any(WARM_WORKERS_OFF_CONF.search(option) for option in options)


def warm_arguments(argv: Sequence[str]) -> list[str]:
    """`argv` with `-m MODULE ARGS...` run as `-m elastic_ddp.handoff.warm_start MODULE ARGS...`, wherever
    `-m` stands among torchrun's options; other entry points (`--no-python`, `--run-path`, a script
    path) unchanged."""
    from torch.distributed.run import parse_args

    args = parse_args(list(argv))
    script_at = len(argv) - len(args.training_script_args) - 1
    if not args.module or args.no_python or args.run_path or argv[script_at] != args.training_script:
        return list(argv)  # not a module, or a spelling torchrun reads otherwise (`-m MODULE -- ARGS`): cold
    return [*argv[:script_at], warm_start.__name__, *argv[script_at:]]


def probed_c10d_arguments(argv: list[str]) -> list[str]:
    """`argv` with torchrun's `--rdzv_backend=c10d` (or `--rdzv-backend c10d`) turned into
    `elastic-c10d`: the same store, elastic_ddp's rendezvous with dead-node probes. The training
    script's own arguments are left alone."""
    from torch.distributed.run import parse_args

    from elastic_ddp.agent.rendezvous.boards.c10d import BACKEND_NAME

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


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    from torch.distributed import run as torchrun

    # Forked once torch is imported: the server imports only the rest while the agent goes on. None:
    # turned off, not Linux, or a thread already runs here.
    server = start_warm_worker_server(announce_ready=True) if may_run_warm(argv) else None
    argv = probed_c10d_arguments(argv)
    torchrun.main(warm_arguments(argv) if server is not None else argv)


if __name__ == "__main__":
    main()
