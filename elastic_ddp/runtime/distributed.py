"""Where this process sits in the job, read from the torchrun environment, and the process group.

`DistributedContext.from_env()` reads what torchrun exports to each worker (RANK, WORLD_SIZE, ...);
run outside torchrun it describes a world of one. `process_group(context, timeout)` sets up gloo
(CPU, or CUDA with several ranks per GPU) or nccl (CUDA) and always tears it down, also when training raises. `exit_worker(code)`
ends a worker process without the interpreter's teardown, which can crash or hang in gloo.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from elastic_ddp.handoff.warm_client import SERVER_PROCESS_NAME as WARM_SERVER_NAME
from elastic_ddp.runtime.procfs import command_line, process_name, read_stat

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistributedContext:
    """This worker's place in the current worker group. Valid for one incarnation only."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    restart_count: int = 0
    run_id: str = "local"

    @classmethod
    def from_env(cls, device_preference: str = "auto", backend_preference: str = "auto") -> DistributedContext:
        """Read torchrun's variables; `device_preference` is auto, cpu or cuda, `backend_preference`
        auto (nccl on CUDA, gloo on the CPU), nccl or gloo. Under nccl local rank N uses GPU N and
        a local rank without a GPU is a ValueError (nccl refuses two ranks on one GPU); under gloo
        the node's ranks share its GPUs round-robin (local rank N on GPU N mod the GPU count)."""
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        use_cuda = device_preference == "cuda" or (device_preference == "auto" and torch.cuda.is_available())
        if use_cuda and not torch.cuda.is_available():
            raise ValueError("--device: got 'cuda'; expected auto or cpu, since CUDA is not available here")
        backend = backend_preference if backend_preference != "auto" else ("nccl" if use_cuda else "gloo")
        device = torch.device("cpu")
        if use_cuda:
            gpus = torch.cuda.device_count()
            if backend == "nccl" and local_rank >= gpus:
                raise ValueError(f"--nproc_per_node: local rank {local_rank} has no GPU of its own (this node has "
                                 f"{gpus}); expected at most one process per GPU under nccl, or --dist_backend gloo")
            device = torch.device("cuda", local_rank % gpus)
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            device=device,
            backend=backend,
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            run_id=os.environ.get("TORCHELASTIC_RUN_ID", "local"),
        )

    @property
    def collective_device(self) -> torch.device:
        """Where the runtime's own small collectives (votes, sizes, byte payloads) put their tensors:
        the training device under nccl, which only moves CUDA tensors; the CPU under gloo, also when
        training on CUDA, which spares each one a device copy and a stream sync."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        return "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def in_process_group(self) -> bool:
        """Launched by torchrun and the default process group is up: collectives can be called."""
        return self.is_distributed and dist.is_initialized()


def agent_pid() -> int:
    """The pid of the torchrun agent that started this worker (this process's parent, or its
    grandparent when the worker was forked from the agent's warm-worker server,
    elastic_ddp/handoff/warm_client.py, or from a multiprocessing fork server: torchrun's `--run-path` with
    `--start-method forkserver`). Without /proc (not Linux) the parent is the answer."""
    parent = os.getppid()
    if process_name(parent) == WARM_SERVER_NAME or b"multiprocessing.forkserver" in command_line(parent):
        stat = read_stat(parent)
        if stat is not None:
            return stat.parent
    return parent


def rank_0s(context: DistributedContext, value: int) -> int:
    """Rank 0's `value` on every rank (a collective of one int64; `value` is `value` alone)."""
    if not context.in_process_group:
        return value
    agreed = torch.tensor([value], dtype=torch.int64, device=context.collective_device)
    dist.broadcast(agreed, src=0)
    return int(agreed.item())


def agree_on_incarnation(context: DistributedContext) -> int:
    """A number shared by all ranks of this worker-group start, larger than any before it: rank 0's
    clock in microseconds (a collective)."""
    return rank_0s(context, time.time_ns() // 1000)


def warn_if_agent_store_shared() -> None:
    """Name the fix when torchrun shares its rendezvous store with the workers.

    With the shared store, workers restarted after a re-rendezvous read the previous round's gloo
    addresses (pytorch/pytorch#135712). Our backends (`--rdzv_backend=elastic-c10d`, `etcd-v3`)
    never share it, and with torch's `c10d` the plugin turns sharing off for `-m elastic_ddp.train`
    and for scripts that import elastic_ddp (elastic_ddp/agent/rendezvous/plugin.py); this fires for
    a module of your own (`-m my_project.train`) on torch's `c10d`, or when something turned sharing
    back on.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        logger.warning(
            "torchrun shares its rendezvous TCPStore with the workers: restarts and joins may hang in "
            "init_process_group. Use --rdzv_backend=elastic-c10d, or start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (the launch/ scripts do).")


def wait_until_listening(host: str, port: int, timeout_s: float, poll_s: float = 0.01) -> bool:
    """Whether `host:port` accepted a TCP connection within `timeout_s` (tried every `poll_s`).

    The other ranks call it before `init_process_group`, whose store client, started before rank
    0's store listens, retries with a backoff that can cost most of a second after the store is up,
    on the critical path of every restart (docs/benchmarks-history.md); once the port listens, it
    connects at its first attempt. The probe connects and closes; the store takes that as a client leaving.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(poll_s, 0.1)):
                return True
        except OSError:
            if time.monotonic() > deadline:
                return False  # init_process_group will say why, with its own timeout
            time.sleep(poll_s)


@contextlib.contextmanager
def process_group(context: DistributedContext, timeout: timedelta) -> Iterator[None]:
    """Initialise the default process group for `context` and destroy it on the way out (the
    group of the moment: an in-process re-form may have replaced the first one).

    `timeout` bounds every collective: a peer that stops answering (frozen, partitioned) makes the
    survivors fail after at most this long, so torchrun can re-rendezvous without it.
    """
    if not context.is_distributed:
        yield
        return
    warn_if_agent_store_shared()
    init_default_group(context, timeout)
    try:
        yield
    finally:
        destroy_default_group()


def init_default_group(context: DistributedContext, timeout: timedelta) -> None:
    """`dist.init_process_group` for `context` from MASTER_ADDR/MASTER_PORT (env://), `timeout`
    bounding its collectives; the other ranks first wait for rank 0's store to listen."""
    if context.rank != 0:
        wait_until_listening(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout.total_seconds())
    if context.device.type == "cuda":
        torch.cuda.set_device(context.device)
    dist.init_process_group(
        backend=context.backend,
        rank=context.rank,
        world_size=context.world_size,
        timeout=timeout,
        # Binds nccl's communicator to this GPU at once; gloo has no use for it.
        device_id=context.device if context.backend == "nccl" else None,
    )


def destroy_default_group() -> None:
    """Destroy the default process group, if any, without raising: after a peer died the group
    may be unusable, and tearing it down must not mask the real error (gloo's returns at once
    then: docs/design/in-process-regroup.md)."""
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception:  # best effort
        logger.debug("destroy_process_group failed", exc_info=True)


# Objects that must outlive the interpreter's last Python frame: see `keep_until_exit`.
_KEPT_UNTIL_EXIT: list[object] = []


def keep_until_exit(obj: object) -> None:
    """Keep `obj` referenced until the process ends, so that it is never freed while Python runs.

    For DistributedDataParallel models: freeing one frees its gloo process group, whose destructor
    joins gloo's worker threads while holding the GIL, and a worker thread still releasing the
    Python tensors of a just-finished collective needs the GIL: deadlock (seen at the end of a
    drain and of a finished run; the agent then waits for the worker forever). Kept objects are
    never freed: `exit_worker` ends the process without the interpreter's teardown. The cost is
    their memory until exit; a process trains one model at a time.
    """
    _KEPT_UNTIL_EXIT.append(obj)


def remove_autograd_hooks(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Remove the gradient hooks a DistributedDataParallel put on its module's parameters (they
    keep its reducer, and so its process group, alive). torch 2.13's private
    `_remove_autograd_hooks`; nothing where a torch lacks it (the group then lives on, unused)."""
    remove = getattr(ddp, "_remove_autograd_hooks", None)
    if remove is not None:
        remove()


def exit_worker(exit_code: int) -> NoReturn:
    """End this worker process with `exit_code` now: flush logging and stdio, then `os._exit`.

    Call it last in a training script run by torchrun, after `Trainer.fit()` returned (fit waits
    until the last snapshot is durable and closes every log), in place of `sys.exit`. It skips the
    interpreter's teardown on purpose: a DistributedDataParallel model keeps its gloo process group
    alive after `destroy_process_group` (the Trainer keeps it until exit, see `keep_until_exit`),
    and freeing it during teardown joins gloo's worker threads while a thread may still need the
    GIL to release a finished collective's tensors. The process
    then aborts ("terminate called without an active exception", exit -6: seen after a finished
    2-worker run) or hangs, and torchrun reports a failed worker group although training finished.
    Python `atexit` handlers do not run; logging is shut down (flushed) first.

    In a worker that multiprocessing started (torchrun's `--run-path` entry points) it raises
    SystemExit instead: torchrun's wrapper there turns `SystemExit(0)` into the return value it
    waits for, and multiprocessing already ends such a process with `os._exit`.
    """
    if multiprocessing.parent_process() is not None:
        sys.exit(exit_code)
    end_worker_now(exit_code)


def end_worker_now(exit_code: int) -> NoReturn:
    """End this process with `exit_code` at once, from any thread: flush logging and stdio, then
    `os._exit` (see `exit_worker` for why no teardown). For a worker that must stop while its main
    thread is blocked in a collective (the peer watchdog)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream must not change the exit code
            stream.flush()
    os._exit(exit_code)
