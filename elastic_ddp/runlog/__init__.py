"""What a run tells: the event log and its schema, the one reader of it, the audit log, progress,
TensorBoard scalars, worker logging, and `RunLog`, which the trainer reports through.

- `schema`: every event kind and its fields, and the log's file name;
- `events`: the writer (rank 0); `history`: the one reader (report, progress, chaos harness,
  benchmarks); `timeline`: the whole run as incarnations, the report's model;
- `audit`: per-rank lines of the samples each committed step trained, and the exactly-once oracle;
- `progress`, `tensorboard`, `metrics`, `startup`, `worker_logging`: what people see;
- `run_log`: `RunLog`, all of the above for one worker group.
"""
