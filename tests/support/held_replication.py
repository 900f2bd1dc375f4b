"""`python -m tests.support.held_replication`: the held trainer (elastic_ddp/chaos/held_train.py)
whose replica sender stops in the middle of a transfer, so that a test can cut a replica target
off during one deterministically (tests/cluster/test_network_partition.py).

    ELASTIC_DDP_HOLD=... ELASTIC_DDP_HOLD_REPLICATION=/tmp/x/replication python -m tests.support.held_replication ...

While the file named by ELASTIC_DDP_HOLD_REPLICATION exists, rank 0's replica sender stops inside
every transfer: after the frame's sizes went out and every target accepted them (the targets now
wait for its bytes), before the header and the payload. It then writes `<file>.held` (JSON: the
step being sent, the time, its pid) and waits until the file is deleted (at most HOLD_LIMIT_S),
then sends the bytes. Training goes on meanwhile (the sender is a thread of its own).

The stop is a wrapper of `ProcessGroupTransport._to_tensor`, which the source calls first for
the header once the frame's sizes are agreed; a test that sees no `.held` file fails, so a change
of those internals cannot make it pass without the transfer having been caught.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from elastic_ddp.chaos.held_train import main
from elastic_ddp.runtime.distributed import exit_worker
from elastic_ddp.snapshot.exchange.transport import MAX_HEADER_BYTES, ProcessGroupTransport

HOLD_REPLICATION_VARIABLE = "ELASTIC_DDP_HOLD_REPLICATION"
HOLD_LIMIT_S = 120.0
POLL_S = 0.01


def held_file(hold: Path) -> Path:
    """Where the sender says that it stopped mid-transfer (and at which step)."""
    return hold.with_name(hold.name + ".held")


def _step_sent(data) -> int | None:
    """The step of a replica frame's header; None for anything else (a chunk of a payload)."""
    if len(data) > MAX_HEADER_BYTES:
        return None
    try:
        header = json.loads(bytes(data))
    except ValueError:  # (UnicodeDecodeError included)
        return None
    return header.get("global_step") if isinstance(header, dict) and header.get("kind") == "snapshot" else None


def hold_replica_sender(hold: Path) -> None:
    """Make every replication frame of this process stop as the module docstring says."""
    to_tensor = ProcessGroupTransport._to_tensor

    def stopping_to_tensor(transport: ProcessGroupTransport, data):
        # A replication frame's header (restores use the default group, chunks of a payload are no JSON).
        step = _step_sent(data) if transport.group is not None and hold.exists() else None
        if step is not None:
            temporary = hold.with_name(hold.name + ".tmp")
            temporary.write_text(json.dumps({"global_step": step, "time": time.time(), "pid": os.getpid()}))
            os.replace(temporary, held_file(hold))
            deadline = time.monotonic() + HOLD_LIMIT_S
            while hold.exists() and time.monotonic() < deadline:
                time.sleep(POLL_S)
        return to_tensor(transport, data)

    ProcessGroupTransport._to_tensor = stopping_to_tensor


if __name__ == "__main__":
    hold_replica_sender(Path(os.environ[HOLD_REPLICATION_VARIABLE]))
    exit_worker(main())
