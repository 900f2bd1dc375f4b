"""What torchrun loads from elastic_ddp at start-up, through the `torchrun.handlers` entry points.

torch's registry imports every `torchrun.handlers` entry point of the environment when an agent
starts, calls it, and registers the returned factory under the entry point's name (`etcd-v3`,
`elastic-c10d`), whatever `--rdzv_backend` the job asked for. So this module must stay in its
lane: it imports nothing heavy (a backend's modules load only when its rendezvous is created), and
it changes nothing for a job that uses neither our backends nor our trainer. A plugin that fails to
load is only logged as a warning by torch.

One exception, for users of torch's own `--rdzv_backend=c10d` with our trainer: workers that share
the agent's TCPStore hang or loop on "Connection refused" after a re-rendezvous
(pytorch/pytorch#135712), so when this agent trains with elastic_ddp (`-m elastic_ddp.train`,
`elastic_ddp.agent.launcher`'s workers, or a script of the user's whose source imports elastic_ddp
at the start of a line: `ElasticRun`'s users), the plugin gives every worker group a store of its
own (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, unless the user set it). Our backends set it themselves
when their rendezvous is created. A module of the user's (`-m my_project.train`) is not looked into
(finding its source would import its package in the agent): its workers warn instead, naming the
fix (`elastic_ddp.runtime.distributed.warn_if_agent_store_shared`).

Every handler created here counts its rendezvous rounds for the node's metrics endpoint
(`elastic_ddp.agent.rendezvous_metrics`).

`etcd-v3` and `elastic-c10d` run elastic_ddp's rendezvous: each node writes keys of its own and one
write closes a round (`handler`; in etcd `boards.etcd`, in the TCPStore `boards.c10d`).
`--rdzv_conf algorithm=` may be left out; its one value, `keyed` (this rendezvous's earlier name,
kept so that existing command lines still start), names it. The other value of earlier versions,
the dynamic algorithm (torch's `DynamicRendezvousHandler` with our additions), is refused with one
line that says it was removed (`take_algorithm`). torch's own `--rdzv_backend=c10d` is torch's and
stays its dynamic rendezvous.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
from collections.abc import Callable, Sequence

from elastic_ddp.agent.rendezvous.defaults import SHARED_STORE_OPT_OUT

# The training modules whose workers need a store of their own (prefixes of the module name).
OUR_TRAINING_MODULES = ("elastic_ddp.",)
# A training script of the user's that imports elastic_ddp: a statement at the start of a line,
# looked for in the script's first bytes (an import comes first; a script is not read whole).
IMPORTS_US = re.compile(rb"^[ \t]*(?:import|from)[ \t]+elastic_ddp\b", re.MULTILINE)
SCRIPT_BYTES_READ = 1 << 20


def _torchrun_arguments(argv: Sequence[str]):
    """torchrun's parsed arguments `argv` when they may run elastic_ddp (a module of ours, or a
    script), else None: other programs that load torch's registry are spared a parse of their argv."""
    if not any(argument.startswith(OUR_TRAINING_MODULES) or argument.endswith(".py") for argument in argv):
        return None
    try:
        from torch.distributed.run import parse_args
    except ImportError:
        # The `torchrun` command imports torch.distributed.run, whose own imports load the plugins:
        # its parser is not defined yet. Decide by the arguments themselves.
        return _scanned_arguments(argv)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return parse_args(list(argv))
    except BaseException:  # noqa: BLE001 - not torchrun's arguments (argparse exits): not our job to decide
        return None


def _scanned_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """torchrun's arguments as far as the plugin needs them, without torchrun's parser: `-m` or
    `--module` anywhere, the first module of ours or script (`.py`) as the training script. It may
    take an option's value for the script; what it decides (a store of its own for the workers)
    costs nothing when wrong."""
    module = "-m" in argv or "--module" in argv
    wanted = (lambda argument: argument.startswith(OUR_TRAINING_MODULES)) if module else (
        lambda argument: argument.endswith(".py"))
    script = next((argument for argument in argv if wanted(argument)), "")
    no_python = "--no-python" in argv or "--no_python" in argv
    return argparse.Namespace(module=module, training_script=script, no_python=no_python)


def script_imports_elastic_ddp(path: str) -> bool:
    """Whether the script at `path` imports elastic_ddp at the start of a line in its first
    SCRIPT_BYTES_READ bytes; False for a file that cannot be read."""
    try:
        with open(path, "rb") as script:
            return IMPORTS_US.search(script.read(SCRIPT_BYTES_READ)) is not None
    except OSError:
        return False


def trains_with_elastic_ddp(argv: Sequence[str]) -> bool:
    """Whether torchrun arguments `argv` run elastic_ddp: one of its training modules
    (`-m elastic_ddp.train`), or a script that imports it."""
    args = _torchrun_arguments(argv)
    if args is None or args.no_python:
        return False
    if args.module:
        return args.training_script.startswith(OUR_TRAINING_MODULES)
    return script_imports_elastic_ddp(args.training_script)


def training_module(argv: Sequence[str]) -> str | None:
    """The module that torchrun arguments `argv` run with `-m`, when it is one of elastic_ddp's."""
    args = _torchrun_arguments(argv)
    if args is None or not args.module or args.no_python:
        return None
    return args.training_script if args.training_script.startswith(OUR_TRAINING_MODULES) else None


def give_our_workers_their_own_store(argv: Sequence[str] | None = None) -> None:
    """Set the shared-store opt-out in this agent when it runs our trainer (see the module docstring)."""
    if SHARED_STORE_OPT_OUT not in os.environ and trains_with_elastic_ddp(sys.argv[1:] if argv is None else argv):
        os.environ[SHARED_STORE_OPT_OUT] = "1"


# `--rdzv_conf algorithm=` of etcd-v3 and elastic-c10d (see the module docstring): the one algorithm.
ALGORITHM_KEY = "algorithm"
ALGORITHM = "keyed"
REMOVED_ALGORITHM = "dynamic"


def take_algorithm(params) -> None:
    """Check the `--rdzv_conf algorithm=` of `params` (`RendezvousParameters`) and remove it from its
    config, so that the backend's own key check does not see it: leaving it out, or `keyed` (its
    earlier name), is the rendezvous; anything else raises ValueError naming the key, the value and
    what is accepted (for `dynamic`, that it was removed)."""
    chosen = params.config.pop(ALGORITHM_KEY, None)
    if chosen in (None, "", ALGORITHM):
        return
    if chosen == REMOVED_ALGORITHM:
        raise ValueError(f"--rdzv_conf {ALGORITHM_KEY}: got {chosen!r}, which was removed in this version of "
                         f"elastic_ddp; expected {ALGORITHM} (the default: leave the key out). torch's dynamic "
                         "rendezvous is torch's own --rdzv_backend=c10d, which elastic_ddp leaves as it is")
    raise ValueError(f"--rdzv_conf {ALGORITHM_KEY}: got {chosen!r}; expected {ALGORITHM} (the only one, and the "
                     "default: leave the key out)")


# `--rdzv_conf warm_workers=` of etcd-v3 and elastic-c10d: whether the agent starts a warm-worker server.
WARM_WORKERS_KEY = "warm_workers"
WARM_WORKERS_VALUES = {"1": True, "0": False}


def take_warm_workers(params) -> bool:
    """The `--rdzv_conf warm_workers=` of `params` (default 1), removed from its config like `algorithm`;
    ValueError naming the key for a bad value."""
    given = str(params.config.pop(WARM_WORKERS_KEY, "1"))
    if given not in WARM_WORKERS_VALUES:
        raise ValueError(f"--rdzv_conf {WARM_WORKERS_KEY}: got {given!r}; expected 1 (the default: workers of "
                         "-m elastic_ddp.train are forked from a warm-worker server) or 0 (each starts cold)")
    return WARM_WORKERS_VALUES[given]


def start_warm_workers(params, argv: Sequence[str] | None = None):
    """Start this agent's warm-worker server (elastic_ddp.agent.warm_workers) when its workers run a
    module that asks for one and `warm_workers` is not 0. None starts where `ELASTIC_DDP_WARM_WORKERS`
    is set: `0`, or a server runs already (`python -m elastic_ddp.agent.launcher` starts one first).
    Returns the server this agent runs (`StartedServer`: the one started now, or the launcher's), or
    None."""
    if not take_warm_workers(params):
        return None
    from elastic_ddp.agent.warm_workers import server_started_here, start_warm_worker_server
    from elastic_ddp.handoff.warm_client import WARM_MODULES

    server = server_started_here()  # the launcher's, started before torchrun
    if server is None and training_module(sys.argv[1:] if argv is None else argv) in WARM_MODULES:
        server = start_warm_worker_server(announce_ready=True)
    return server


def ready_handler(handler, server):
    """`handler` (a `RoundRendezvousHandler`), set to wait until `server` (None: no server) has its
    imports, at most `READY_WAIT_S`, before it first arrives at a round of a job that runs without
    this node: that round stops the running nodes, which would then wait in `init_process_group` for
    its workers' imports. A job's first round and a member's next ones do not wait."""
    if server is not None:
        from elastic_ddp.agent.warm_workers import READY_WAIT_S

        handler.before_joining_a_running_job(lambda: server.wait_until_ready(READY_WAIT_S))
    return handler


def etcd_v3_handler_factory() -> Callable:
    """Entry point `etcd-v3`: the factory torchrun calls with its `RendezvousParameters`."""
    give_our_workers_their_own_store()

    def create_handler(params):
        from elastic_ddp.agent.rendezvous.boards.etcd import create_etcd_v3_handler
        from elastic_ddp.agent.rendezvous_metrics import count_rounds

        take_algorithm(params)
        server = start_warm_workers(params)  # first: it imports while the handler connects
        return count_rounds(ready_handler(create_etcd_v3_handler(params), server))

    return create_handler


def elastic_c10d_handler_factory() -> Callable:
    """Entry point `elastic-c10d`: elastic_ddp's rendezvous in a TCPStore (`boards.c10d`)."""
    give_our_workers_their_own_store()

    def create_handler(params):
        from elastic_ddp.agent.rendezvous.boards.c10d import create_elastic_c10d_handler
        from elastic_ddp.agent.rendezvous_metrics import count_rounds

        take_algorithm(params)
        server = start_warm_workers(params)  # first: it imports while the handler connects
        return count_rounds(ready_handler(create_elastic_c10d_handler(params), server))

    return create_handler
