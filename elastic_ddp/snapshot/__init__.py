"""Snapshots: what a run's state is, where it is kept, and how it moves.

- `state`: `TrainingState` (the components a restart carries over) and `Snapshot` (its data);
- `format`: a snapshot as bytes (loaded with weights_only=True only);
- `staging`: CPU copies the background writer reads while training goes on;
- `storage`: where files live (a local directory or an fsspec URL), written all-or-nothing;
- `store`: `SnapshotStore`, the manifest, checksums, keep-last pruning;
- `writer`: rank 0's background writer;
- `transport`: the one way snapshot bytes move between ranks (frames over a process group);
- `recovery`: the group's agreement on the newest state any rank can read;
- `replication`: copies on other nodes' disks: who holds them; `replica_transfer`: how one gets there;
- `session`: `SnapshotSession`, all of the above as the trainer uses it;
- `loading`: `load_snapshot`, for reading a run's result from outside a job.

Importing this package imports nothing else (the store is used by `elastic-ddp inspect` without torch).
"""
