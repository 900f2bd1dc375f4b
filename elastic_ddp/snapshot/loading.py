"""Reading a run's result from outside a training job: `elastic_ddp.load_snapshot`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from elastic_ddp.snapshot.files.snapshot_store import SnapshotStore
from elastic_ddp.snapshot.serialization import public_dict, snapshot_from_bytes, snapshot_from_file
from elastic_ddp.snapshot.sharded import step_directories as sharded_steps
from elastic_ddp.snapshot.sharded.safe_reader import read_tensors
from elastic_ddp.snapshot.sharded.shared_choice import newest_that_verifies

_MODEL, _OPTIMIZER_STATE = "model.", "optimizer.state."


def load_snapshot(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The newest valid snapshot in `checkpoint_dir` (a directory, or an object-store URL of a DDP
    run), as a dict, from a DDP run (a snapshot file) or a `--sharding fsdp` run (a sharded step directory, its shards read whole onto the CPU):
    whichever is newer. No process group is needed.

    Keys include `model` (a state dict, by parameter name), `optimizer`, `scheduler`, `epoch`,
    `global_step` and `samples_consumed` (docs/snapshots.md lists them all). The optimizer state of
    a sharded run is keyed by parameter name (`state[name][key]`, and names in `param_groups`), the
    form of `torch.distributed.checkpoint.state_dict`; a DDP run's by index, as
    `Optimizer.state_dict` gives it. Newer snapshots that fail their checksum or do not load
    safely are skipped with a warning; on node-local disks a sharded step counts only in a
    directory that holds every one of its files. Raises FileNotFoundError when the directory holds
    no valid snapshot.
    """
    store = SnapshotStore(checkpoint_dir)  # a directory or an object-store URL (sharded runs: directories only)
    found = store.latest_valid(accept=snapshot_from_bytes)
    single = None if found is None else public_dict(snapshot_from_bytes(found[1], store.describe(found[0].file)))
    root = store.storage.local_directory  # None: an object store, where sharded runs never write
    sharded = None if root is None else newest_that_verifies(root, fingerprint=None)
    if sharded is not None and (single is None or sharded[2] >= single["global_step"]):
        return _read_sharded_step(root / sharded[0])
    if single is None:
        raise FileNotFoundError(f"{checkpoint_dir}: no valid elastic_ddp snapshot, neither a file nor a sharded step "
                                "(is it a --checkpoint_dir?)")
    return single


def _read_sharded_step(directory: Path) -> dict[str, Any]:
    """A verified sharded step as `load_snapshot` returns it: the unsharded rest (trainer.snap),
    with the model and the optimizer's tensors from the DCP files."""
    trainer_file = directory / sharded_steps.TRAINER_FILE
    plain, _ = snapshot_from_file(trainer_file, str(trainer_file))
    snapshot = public_dict(plain)
    tensors = read_tensors(directory)
    model = {name[len(_MODEL):]: value for name, value in tensors.items() if name.startswith(_MODEL)}
    # DCP flattens the optimizer state to optimizer.state.<parameter name>.<key>; a key has no dot.
    state: dict[str, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith(_OPTIMIZER_STATE):
            parameter, _, key = name[len(_OPTIMIZER_STATE):].rpartition(".")
            state.setdefault(parameter, {})[key] = value
    snapshot["model"] = model
    snapshot["optimizer"] = {"state": state, "param_groups": (snapshot["optimizer"] or {}).get("param_groups", [])}
    return snapshot
