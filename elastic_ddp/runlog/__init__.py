"""What a run tells: the event log and its schema, the one reader of it, the audit log, progress,
TensorBoard scalars, worker logging and the start-up timeline.

- `schema`: every event kind and its fields, and the log's file name;
- `events`: the writer (rank 0); `reader`: the one reader (report, progress, chaos harness,
  benchmarks); `run_history`: the whole run as incarnations, the report's model;
- `audit`: per-rank lines of the samples each committed step trained, and the exactly-once oracle;
- `progress`, `tensorboard`, `startup`, `worker_logging`: what people see;
- `metrics`: live Prometheus metrics fed by rank 0's events; `metrics_node` and `metrics_server`: the
  node's metrics directory and the /metrics server that outlives worker groups.

The trainer reports through `RunLog` (elastic_ddp/training/reporting.py), which gathers all of
the above for one worker group, and its loss and throughput windows (training/loss_window.py).
"""
