"""The event log's schema: its file name, and every event kind with its fields, declared once.

Every line of the event log is a JSON object with `time` (Unix seconds), `event` (a kind below) and
`incarnation` (the worker-group start that wrote it), plus the fields of its kind. `EventLog.emit`
refuses a kind that is not declared here or fields that differ from the declaration, and every
reader (`runlog.reader`: the report, progress, the chaos harness, the benchmarks) reads through
one parser, so a new kind is added here and nowhere else; `tests/unit/test_runlog.py` fails when
the report does not handle a declared kind. docs/operations.md ("Event log") lists them for people.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

EVENT_LOG_NAME = "events.jsonl"
COMMON_FIELDS = ("time", "event", "incarnation")


@dataclass(frozen=True)
class EventKind:
    """One kind of event: its name in the `event` field and the fields every event of it carries."""

    name: str
    fields: tuple[str, ...]
    meaning: str

    @cached_property
    def field_set(self) -> frozenset[str]:
        return frozenset(self.fields)

    def __str__(self) -> str:
        return self.name


START = EventKind(
    "start", ("round", "world_size", "local_world_size", "nodes", "ranks", "restart_count", "run_id", "in_process"),
    "a worker group began: its rendezvous round as numbered by this run, its world, and where every rank runs; "
    "`in_process`: the survivors' workers re-formed it in their own processes (no restart)")
RESTORE = EventKind(
    "restore", ("global_step", "epoch", "samples_consumed", "checksum", "verified", "source", "source_rank",
                "source_host", "file", "previous_world_size", "world_size", "lost_steps", "lost_seconds", "refused"),
    "the group resumed from a snapshot file or a memory copy (`source`: file or memory, kept by `source_rank` "
    "on `source_host`), and what that cost; `refused`: the newer copies some rank refused (`source`, "
    "`global_step`, `host`, `reason`, such as `non-finite: model.w`), newest first")
STARTUP = EventKind(
    "startup", ("global_step", "process_started", "seconds"),
    "seconds from rank 0's process start to each stage of its start-up, after the first step")
STEP = EventKind("step", ("global_step", "epoch"), "an optimizer step was committed")
PROGRESS = EventKind(
    "progress", ("global_step", "epoch", "loss", "lr", "samples_per_second", "world_size"),
    "every --log_interval steps: the mean loss over all ranks since the last one, and the throughput")
EPOCH_END = EventKind("epoch_end", ("epoch", "global_step"), "the last step of an epoch was committed")
EVAL = EventKind(
    "eval", ("global_step", "epoch", "loss", "accuracy", "samples"),
    "the model after `global_step` on the held-out set (--eval_dataset): mean per-sample loss, accuracy (null "
    "when the targets are not class indices), over `samples` samples")
SNAPSHOT_CAPTURED = EventKind(
    "snapshot_captured", ("global_step", "blocked_seconds"),
    "rank 0 copied the state for a snapshot; training was blocked this long")
SNAPSHOT_CADENCE = EventKind(
    "snapshot_cadence", ("global_step", "every_steps", "interval_s", "blocked_seconds", "writer_cpu_seconds", "budget"),
    "rank 0 spaced the durable snapshots on the overhead budget (--snapshot_budget): the next one in `every_steps` "
    "steps (about `interval_s` seconds), as the snapshot of `global_step` blocked training `blocked_seconds` and "
    "its background write took `writer_cpu_seconds` of CPU from training's cores (0 where a core is spare)")
SNAPSHOT = EventKind(
    "snapshot", ("global_step", "epoch", "file", "checksum", "size_bytes", "write_seconds"),
    "a snapshot is durable and listed (the only kind a restore may name)")
SNAPSHOT_FAILED = EventKind(
    "snapshot_failed", ("global_step", "error"),
    "a snapshot could not be captured or written; the previous ones are kept")
REPLICATION = EventKind(
    "replication", ("replicas", "target_nodes", "target_ranks"),
    "who receives snapshot replicas in this worker group")
SNAPSHOT_REPLICATED = EventKind(
    "snapshot_replicated", ("global_step", "checksum", "nodes", "seconds"),
    "a snapshot reached the checkpoint directories of these nodes")
REPLICATION_FAILED = EventKind(
    "replication_failed", ("global_step", "node", "error"),
    "a snapshot did not reach a node's checkpoint directory")
MEMORY_COPY = EventKind(
    "memory_copy", ("global_step", "reason", "size_bytes", "seconds", "written"),
    "training stopped early (`reason`); rank 0 kept the state of its last committed step in its node's memory "
    "(`written` false: a sibling rank of the node had already kept it)")
MEMORY_COPY_FAILED = EventKind(
    "memory_copy_failed", ("global_step", "reason", "error"),
    "training stopped early (`reason`) and rank 0 kept no memory copy of its last committed step (`error`: its "
    "state held a NaN or an infinity, the training thread was stuck inside a commit, no room, ...)")
DRAIN = EventKind(
    "drain", ("global_step", "snapshot_durable", "seconds_since_signal"),
    "the group stopped on a SIGTERM after its final snapshot (a drain, or torchrun re-forming the group)")
AMP_STEP_SKIPPED = EventKind(
    "amp_step_skipped", ("global_step", "scale"),
    "fp16 gradients held inf or NaN: GradScaler skipped this step's optimizer update (the step and its data still "
    "count, as in torch's AMP) and lowered its loss scale to `scale`")
FINISHED = EventKind("finished", ("global_step", "seconds"), "every epoch is trained and the last snapshot is durable")
STRAGGLER = EventKind(
    "straggler", ("state", "rank", "node", "score", "own_score", "pace_seconds", "best_pace_seconds"),
    "rank 0 named a rank slow (`state`: named) or back to the others' speed (recovered): `score` is the best "
    "rank's own time per sample over this rank's (1: as fast as the fastest), `own_score` its own best over its "
    "pace now, `pace_seconds` its own time per sample outside the run's collectives (training/stragglers.py)")

EVENT_KINDS: dict[str, EventKind] = {kind.name: kind for kind in (
    START, RESTORE, STARTUP, STEP, PROGRESS, EPOCH_END, EVAL, SNAPSHOT_CAPTURED, SNAPSHOT_CADENCE, SNAPSHOT, SNAPSHOT_FAILED,
    REPLICATION, SNAPSHOT_REPLICATED, REPLICATION_FAILED, MEMORY_COPY, MEMORY_COPY_FAILED, DRAIN, AMP_STEP_SKIPPED,
    FINISHED, STRAGGLER)}
