"""The verdict of a chaos run: did every promise hold? (docs/failure-semantics.md)

`judge` reads what the run left behind (the event log, the audit log, the agents' exit codes) and
checks, for the whole run:

- it finished, and its final global step is exactly epochs x steps per epoch;
- the audit log shows every sample of every epoch exactly once in the surviving trajectory
  (`runlog.audit.exactly_once_violations`);
- every restore used a snapshot whose write had completed, with the checksum that write recorded;
- every fault of the plan fired;

and it measures, per fault, the seconds from the fault to the first optimizer step of the group
that continued without the node (or, for a join, with it).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from elastic_ddp.chaos.cluster import LocalJob
from elastic_ddp.chaos.plan import REMOVING_ACTIONS, FaultPlan
from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog import schema
from elastic_ddp.runlog.audit import exactly_once_violations, read_entries
from elastic_ddp.runlog.history import WorkerGroup, read_events


@dataclass
class FaultRecord:
    """What happened to one fault of the plan."""

    index: int
    description: str
    fault: dict[str, Any]
    fired: bool = False
    fired_at: float | None = None  # Unix seconds
    seconds_into_run: float | None = None
    step_when_fired: int | None = None  # newest global step in the event log at that moment
    node: str | None = None
    pid: int | None = None  # the agent's, or the worker's for kill_worker
    held_rank0: bool | None = None
    snapshot_step: int | None = None  # for on_event=snapshot_captured: the snapshot being written
    during_snapshot_write: bool | None = None  # its write had not completed when the kill landed
    recovery_seconds: float | None = None  # to the first step of the next group (with the joiner)
    not_fired_because: str | None = None


@dataclass
class ChaosReport:
    """The outcome of one chaos run; `problems` is empty when every promise held."""

    run_dir: str
    plan: dict[str, Any]
    faults: list[FaultRecord]
    expected_final_step: int
    final_step: int | None
    exactly_once_problems: list[str]
    restores: list[dict[str, Any]]
    interrupted_snapshot_writes: list[int]
    world_sizes: list[int]
    exit_codes: dict[str, int | None]
    ended: dict[str, float]  # seconds into the run when each agent that ended on its own was seen gone
    seconds: float
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def summary(self) -> str:
        lines = [f"chaos run in {self.run_dir}: {'OK' if self.ok else 'FAILED'} in {self.seconds:.1f} s",
                 f"  world sizes: {' -> '.join(map(str, self.world_sizes))}"]
        for record in self.faults:
            if not record.fired:
                lines.append(f"  [{record.index}] {record.description}: NOT FIRED ({record.not_fired_because})")
                continue
            details = [f"t={record.seconds_into_run:.1f}s", f"step {record.step_when_fired}"]
            if record.node:
                details.append(record.node + (" (rank 0)" if record.held_rank0 else ""))
            if record.during_snapshot_write is not None:
                details.append(f"snapshot {record.snapshot_step} "
                               f"{'interrupted mid-write' if record.during_snapshot_write else 'already written'}")
            if record.recovery_seconds is not None:
                details.append(f"training again after {record.recovery_seconds:.1f} s")
            lines.append(f"  [{record.index}] {record.description}: {', '.join(details)}")
        lines.append(f"  final step {self.final_step} (expected {self.expected_final_step}); "
                     f"exactly once: {'yes' if not self.exactly_once_problems else 'NO'}; "
                     f"{len(self.restores)} restores, all verified: "
                     f"{'yes' if all(r['matches_a_completed_write'] for r in self.restores) else 'NO'}")
        lines += [f"  problem: {problem}" for problem in self.problems]
        return "\n".join(lines)


def judge(job: LocalJob, plan: FaultPlan, config: TrainingConfig, expected_steps: int,
          records: list[FaultRecord], problems: list[str], groups: list[WorkerGroup],
          ended: dict[str, float], started_at: float) -> ChaosReport:
    """The report of a finished run: `problems` (the harness's own, such as a deadline) plus every
    promise that broke."""
    events = read_events(job.event_log)
    for record in records:
        if record.fired:
            record.recovery_seconds = _recovery_seconds(record, groups)

    def of_kind(kind: schema.EventKind) -> list[dict[str, Any]]:
        return [event for event in events if event["event"] == kind.name]

    written = {(e["global_step"], e["checksum"]) for e in of_kind(schema.SNAPSHOT)}
    restores = [{"global_step": e["global_step"], "checksum": e["checksum"], "verified": e.get("verified"),
                 "matches_a_completed_write": bool(e.get("verified")) and (e["global_step"], e["checksum"]) in written,
                 "previous_world_size": e.get("previous_world_size"), "world_size": e.get("world_size"),
                 "lost_steps": e.get("lost_steps"), "lost_seconds": e.get("lost_seconds")}
                for e in of_kind(schema.RESTORE)]
    captured = {(e["incarnation"], e["global_step"]) for e in of_kind(schema.SNAPSHOT_CAPTURED)}
    completed = {(e["incarnation"], e["global_step"]) for e in of_kind(schema.SNAPSHOT)}
    interrupted = sorted(step for incarnation, step in captured - completed)
    finished = [e["global_step"] for e in of_kind(schema.FINISHED)]
    final_step = max(finished) if finished else None
    exactly_once = exactly_once_violations(read_entries(job.audit_dir), config.dataset_size, config.epochs,
                                           config.global_batch_size, config.drop_last)
    if final_step != expected_steps:
        problems.append(f"final step {final_step}, expected {expected_steps}")
    problems += [f"exactly once: {problem}" for problem in exactly_once]
    problems += [f"restore of step {r['global_step']} (checksum {r['checksum'][:20]}...) matches no completed "
                 "snapshot write" for r in restores if not r["matches_a_completed_write"]]
    problems += [f"fault {r.index} ({r.description}) did not fire: {r.not_fired_because}"
                 for r in records if not r.fired]
    return ChaosReport(
        run_dir=str(job.run_dir), plan=plan.to_dict(), faults=records, expected_final_step=expected_steps,
        final_step=final_step, exactly_once_problems=exactly_once, restores=restores,
        interrupted_snapshot_writes=interrupted, world_sizes=[g.start["world_size"] for g in groups],
        exit_codes={node.name: node.process.poll() for node in job.nodes}, ended=ended,
        seconds=round(time.time() - started_at, 1), problems=problems)


def _recovery_seconds(record: FaultRecord, groups: list[WorkerGroup]) -> float | None:
    """Seconds from the fault to the first step of the first group that reflects it."""
    after = [g for g in groups if g.started >= record.fired_at and g.first_step is not None]
    if record.fault["action"] == "add_node":
        after = [g for g in after if record.pid in g.agent_pids]
    elif record.fault["action"] not in (*REMOVING_ACTIONS, "kill_worker"):
        return None
    return round(after[0].first_step["time"] - record.fired_at, 3) if after else None
