"""What the torchrun command that started this job will cost on a failure, said once at start.

Users copy torchrun's documented command line, and two of torch's defaults decide what a failure
costs them without a word in the log (docs/benchmarks.md):

- torch's own rendezvous backends (`c10d`, `etcd`, `etcd-v2`) wait a *last call* of 30 s
  (`last_call_timeout`) before a round with fewer than the maximum nodes completes, so in an
  elastic range (`--nnodes=MIN:MAX`) every peer failure or join costs at least that long;
- `--max_restarts` defaults to 0, so in an elastic range the first worker failure ends the node.

`warn_about_launch_costs()` reads the agent's command line (/proc/<agent pid>/cmdline; torchrun,
`python -m torch.distributed.run` or our warm launcher), parses it with torchrun's own parser, and
logs one warning per cost with the fix. It runs on rank 0 only, and says nothing when it cannot read
or parse the command line (another launcher, not Linux). Our backends (`elastic-c10d`, `etcd-v3`)
ship a short last call; their value is not second-guessed here, only a `last_call_timeout` given
explicitly in `--rdzv_conf`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.run import get_args_parser, parse_min_max_nnodes

from elastic_ddp.runtime.procfs import command_line

logger = logging.getLogger(__name__)

TORCH_LAST_CALL_S = 30.0  # torch's dynamic rendezvous default (RendezvousTimeout.last_call)
TORCH_BACKENDS = ("c10d", "etcd", "etcd-v2")  # backends whose last call is torch's default
LAST_CALL_WORTH_A_WARNING_S = 5.0  # a recovery here takes 2.5-9 s: a last call beyond this dominates it
# How the agent's argv starts, by launcher: the torchrun arguments follow these.
LAUNCHER_MARKERS = ("torchrun", "torch.distributed.run", "elastic_ddp.agent.launcher")
TUNED_RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5"


@dataclass(frozen=True)
class LaunchSettings:
    """What the torchrun command line says about failures."""

    rdzv_backend: str
    rdzv_conf: dict[str, str]
    min_nodes: int
    max_nodes: int
    max_restarts: int

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.max_nodes

    def last_call_s(self) -> float | None:
        """The last call this rendezvous waits (seconds), None when our backend's shipped one applies."""
        given = self.rdzv_conf.get("last_call_timeout")
        if given is not None:
            try:
                return float(given)
            except ValueError:
                return None  # torchrun refuses it itself
        return TORCH_LAST_CALL_S if self.rdzv_backend in TORCH_BACKENDS else None


def torchrun_arguments(argv: Sequence[str]) -> list[str] | None:
    """The torchrun arguments in a launcher's argv (after the torchrun script or module), or None."""
    for index, item in enumerate(argv):
        if any(item == marker or item.endswith("/" + marker) for marker in LAUNCHER_MARKERS):
            return list(argv[index + 1:])
    return None


def parse_launch(arguments: Sequence[str]) -> LaunchSettings | None:
    """Parse torchrun `arguments` with torchrun's own parser; None when they do not parse."""
    try:
        args = get_args_parser().parse_args(list(arguments))
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    except (SystemExit, ValueError, RuntimeError):  # argparse exits on what torchrun would refuse
        return None
    conf = dict(item.split("=", 1) for item in args.rdzv_conf.split(",") if "=" in item)
    backend = "static" if args.standalone else args.rdzv_backend
    return LaunchSettings(backend, conf, min_nodes, max_nodes, args.max_restarts)


def launch_warnings(settings: LaunchSettings) -> list[str]:
    """One line per failure cost worth saying (see the module docstring); [] when there is none."""
    if not settings.elastic:
        return []
    warnings = []
    last_call = settings.last_call_s()
    if last_call is not None and last_call > LAST_CALL_WORTH_A_WARNING_S:
        warnings.append(
            f"--rdzv_backend={settings.rdzv_backend} waits a last call of {last_call:g} s (last_call_timeout) before "
            f"a round with fewer than {settings.max_nodes} nodes completes: every peer failure or join costs at least "
            f"{last_call:g} s. Use --rdzv_backend=elastic-c10d, or --rdzv_conf={TUNED_RDZV_CONF}")
    if settings.max_restarts == 0:
        warnings.append(
            f"--max_restarts=0 (torchrun's default) with --nnodes={settings.min_nodes}:{settings.max_nodes}: the first "
            "worker failure ends this node and no failure is survived. Add --max_restarts=N (e.g. 10)")
    return warnings


def warn_about_launch_costs(agent_pid: int) -> list[str]:
    """Log (and return) the warnings for the command line of the torchrun agent `agent_pid`."""
    argv = [part.decode(errors="replace") for part in command_line(agent_pid).split(b"\0") if part]
    arguments = torchrun_arguments(argv)
    settings = parse_launch(arguments) if arguments is not None else None
    warnings = launch_warnings(settings) if settings is not None else []
    for line in warnings:
        logger.warning("%s", line)
    return warnings
