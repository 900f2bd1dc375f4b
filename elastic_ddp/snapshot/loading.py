"""Reading a run's result from outside a training job: `elastic_ddp.load_snapshot`."""

from __future__ import annotations

import os
from typing import Any

from elastic_ddp.snapshot.serialization import public_dict, snapshot_from_bytes
from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore


def load_snapshot(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The newest valid snapshot in `checkpoint_dir`, as a dict.

    Keys include `model` (a state dict), `optimizer`, `scheduler`, `epoch`, `global_step` and
    `samples_consumed` (docs/snapshots.md lists them all). Newer snapshots that fail their
    checksum or do not load safely are skipped with a warning. Raises FileNotFoundError when the
    directory holds no valid snapshot.
    """
    store = SnapshotStore(checkpoint_dir)
    found = store.latest_valid(accept=snapshot_from_bytes)
    if found is None:
        raise FileNotFoundError(f"{checkpoint_dir}: no valid elastic_ddp snapshot (is it a --checkpoint_dir?)")
    entry, data = found
    return public_dict(snapshot_from_bytes(data, store.describe(entry.file)))
