"""Reading a run's results from outside a training job."""

from __future__ import annotations

import os
from typing import Any

from elastic_ddp.checkpoint import CheckpointStore
from elastic_ddp.snapshot import Snapshot


def load_snapshot(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The newest valid snapshot in `checkpoint_dir`, as a dict.

    Keys include `model` (a state dict), `optimizer`, `scheduler`, `epoch`, `global_step` and
    `samples_consumed`. Newer snapshots that fail their checksum or do not load safely are skipped
    with a warning. Raises FileNotFoundError when the directory holds no valid snapshot.
    """
    store = CheckpointStore(checkpoint_dir)
    found = store.latest_valid(accept=lambda data, path: Snapshot.from_bytes(data, path))
    if found is None:
        raise FileNotFoundError(f"{checkpoint_dir}: no valid elastic_ddp snapshot (is it a --checkpoint_dir?)")
    entry, data = found
    return Snapshot.from_bytes(data, store.describe(entry.file)).public_dict()
