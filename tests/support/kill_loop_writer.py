"""A process that does nothing but write snapshots, for tests/cluster/test_snapshot_kill_loop.py.

It is a fork server, so that the test can SIGKILL hundreds of writers without paying for
`import torch` each time. Commands on stdin, one per line, answers on stdout:

    fork DIR FIRST_STEP   fork a writer of DIR's snapshots FIRST_STEP, FIRST_STEP + 1, ... forever;
                          answers its pid
    reap PID              wait for that (killed) writer; answers "reaped"

Each writer is a real `SnapshotStore` client writing real `Snapshot`s of an MLP with SGD momentum
(about 5 MB, so that a write takes long enough for kills to land inside it) the way the trainer's
writer thread does (`write_stream`), and appends the step of every write that returned to
DIR/durable.log with one O_APPEND write per line.

    python -m tests.support.kill_loop_writer
"""

from __future__ import annotations

import os
import sys

import torch

from elastic_ddp.snapshot.serialization import write_snapshot
from elastic_ddp.snapshot.staging import StagingBuffers
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from tests.support.snapshots import make_snapshot

DURABLE_LOG = "durable.log"
KEEP_LAST = 2


def build_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    hidden = 512
    shapes = {"net.1.weight": (hidden, 768), "net.3.weight": (hidden, hidden), "net.5.weight": (10, hidden)}
    return {name: torch.randn(shape) for name, shape in shapes.items()}


def write_forever(directory: str, first_step: int, state: dict[str, torch.Tensor]) -> None:
    store = SnapshotStore(directory, keep_last=KEEP_LAST)
    staging = StagingBuffers()
    durable = os.open(os.path.join(directory, DURABLE_LOG), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    step = first_step
    while True:
        for tensor in state.values():
            tensor.add_(1.0)
        snapshot = make_snapshot(step, model=staging.copy(state, "model"), optimizer={"momentum": staging.copy(state, "m")},
                                 fingerprint={"writer": "kill-loop"}, incarnation=first_step)
        store.write_stream(step, 0, step, lambda file: write_snapshot(snapshot, file))  # the writer's path
        os.write(durable, f"{step}\n".encode())
        step += 1


def serve() -> None:
    torch.set_num_threads(1)  # no OpenMP pool in the parent: forked children stay safe
    state = build_state()
    for line in sys.stdin:
        command, *args = line.split()
        if command == "fork":
            pid = os.fork()
            if pid == 0:
                devnull = os.open(os.devnull, os.O_RDWR)
                os.dup2(devnull, 0)
                os.dup2(devnull, 1)
                try:
                    write_forever(args[0], int(args[1]), state)
                finally:
                    os._exit(1)  # never return into the server loop
            print(pid, flush=True)
        elif command == "reap":
            os.waitpid(int(args[0]), 0)
            print("reaped", flush=True)


if __name__ == "__main__":
    serve()
