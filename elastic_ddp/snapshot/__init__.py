"""Snapshots: what a run's state is, where it is kept, and how it moves.

`files/`, the torch-free core (`elastic-ddp inspect` reads snapshots with it alone):
- `file_layout`: a format-2 file (magic, JSON header, payload, checksummed trailer);
- `checksum`: checksums by name ("algorithm:hex"); `strict_json`: the one parser of untrusted headers;
- `backends`: where files live (a local directory or an fsspec URL), written all-or-nothing;
- `manifest`: `ManifestEntry`, the index of a directory and the snapshot file names;
- `snapshot_store`: `SnapshotStore`, atomic, verified writes and reads, keep-last pruning;
- `writeback`: early writeback while a file is written; `errors`: the snapshot error types.

`exchange/`, between ranks:
- `transport`: the one way snapshot bytes move between ranks (frames over a process group);
- `restore_agreement`: the group's agreement on the newest state any rank can read;
- `replication`: copies on other nodes' disks: who holds them; `replica_transfer`: how one gets there;
- `rng_gather`: every rank's RNG state, gathered for a snapshot.

And here:
- `training_state`: `TrainingState` (the components a restart carries over) and `Snapshot` (its data);
- `serialization`: a snapshot as bytes (loaded with weights_only=True only);
- `staging`: CPU copies the background writer reads while training goes on;
- `memory_copies`: the memory tier, each rank's copy of its last committed step;
- `background_writer`: rank 0's background writer;
- `manager`: `SnapshotSession`, all of the above as the trainer uses it;
- `loading`: `load_snapshot`, for reading a run's result from outside a job.

Importing this package imports nothing else.
"""
