"""The verdict of a chaos run: did every promise hold? (docs/failure-semantics.md)

`judge` reads what the run left behind (the event log, the audit log, the agents' exit codes) and
checks, for the whole run:

- it finished, and its final global step is exactly epochs x steps per epoch;
- the audit log shows every sample of every epoch exactly once in the surviving trajectory
  (`runlog.audit.exactly_once_violations`);
- every restore is trusted: a snapshot file whose write had completed, with the checksum that
  write recorded, or a verified memory copy of a committed step, or the survivors' own state of a
  committed step when they re-formed the group in process (`live`: it never left their memory, so
  there is no copy to verify) (a committed step: at most one step after the newest
  step that rank 0 had logged or any rank of an earlier incarnation had audited: the survivors may
  have committed the step rank 0 died in, and a SIGKILL of rank 0 loses the `step` lines its event
  log had not yet written, runlog/events.py);
- no fault cost more than one committed step (the restore that followed it is at most one step
  behind the newest step committed before it, by rank 0's log (`lost_steps`) or by the audit log
  of the incarnation before; 1 when the fault hit the middle of a step), except a fault that ended
  the whole job (the node hosting the c10d store);
- every fault of the plan fired;

and it measures, per fault, the seconds from the fault to the first optimizer step of the group
that continued without the node (or, for a join, with it).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from elastic_ddp.chaos.plan import REMOVING_ACTIONS, FaultPlan
from elastic_ddp.config import TrainingConfig
from elastic_ddp.runlog import schema
from elastic_ddp.runlog.audit import exactly_once_violations, read_entries
from elastic_ddp.runlog.reader import WorkerGroup, read_events
from elastic_ddp.testbed.local_cluster import LocalJob


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
                     f"{len(self.restores)} restores ({sum(r['source'] == 'memory' for r in self.restores)} from memory, "
                     f"{sum(r['source'] == 'live' for r in self.restores)} kept in process), "
                     f"all trusted: {'yes' if all(r['trusted'] for r in self.restores) else 'NO'}; "
                     f"steps lost: {[r['lost_steps'] for r in self.restores]}")
        lines += [f"  problem: {problem}" for problem in self.problems]
        return "\n".join(lines)


# A fault may cost the step it interrupted, never one that every survivor had committed.
MAX_LOST_STEPS = 1


def judge(job: LocalJob, plan: FaultPlan, config: TrainingConfig, expected_steps: int,
          records: list[FaultRecord], problems: list[str], groups: list[WorkerGroup],
          ended: dict[str, float], started_at: float, whole_job_nodes: frozenset[str] = frozenset()) -> ChaosReport:
    """The report of a finished run: `problems` (the harness's own, such as a deadline) plus every
    promise that broke. `whole_job_nodes`: the nodes whose loss ends the whole job."""
    events = read_events(job.event_log)
    for record in records:
        if record.fired:
            record.recovery_seconds = _recovery_seconds(record, groups)

    def of_kind(kind: schema.EventKind) -> list[dict[str, Any]]:
        return [event for event in events if event["event"] == kind.name]

    audit_entries = read_entries(job.audit_dir)
    audited = newest_audited_steps(audit_entries)
    restores = [{"time": e["time"], "global_step": e["global_step"], "checksum": e["checksum"],
                 "verified": e.get("verified"), "source": e.get("source") or "file",
                 "trusted": _trusted(e, events, audited), "previous_world_size": e.get("previous_world_size"),
                 "world_size": e.get("world_size"), "lost_steps": _lost_steps(e, audited),
                 "lost_seconds": e.get("lost_seconds")}
                for e in of_kind(schema.RESTORE)]
    captured = {(e["incarnation"], e["global_step"]) for e in of_kind(schema.SNAPSHOT_CAPTURED)}
    completed = {(e["incarnation"], e["global_step"]) for e in of_kind(schema.SNAPSHOT)}
    interrupted = sorted(step for incarnation, step in captured - completed)
    finished = [e["global_step"] for e in of_kind(schema.FINISHED)]
    final_step = max(finished) if finished else None
    exactly_once = exactly_once_violations(audit_entries, config.dataset_size, config.epochs,
                                           config.global_batch_size, config.drop_last)
    if final_step != expected_steps:
        problems.append(f"final step {final_step}, expected {expected_steps}")
    problems += [f"exactly once: {problem}" for problem in exactly_once]
    problems += [f"restore of step {r['global_step']} (checksum {r['checksum'][:20]}...) matches no completed "
                 "snapshot write" for r in restores if r["source"] == "file" and not r["trusted"]]
    problems += [f"restore of step {r['global_step']} from memory is not a verified copy of a committed step"
                 for r in restores if r["source"] in ("memory", "live") and not r["trusted"]]
    problems += _lost_steps_problems(records, restores, whole_job_nodes)
    problems += [f"fault {r.index} ({r.description}) did not fire: {r.not_fired_because}"
                 for r in records if not r.fired]
    return ChaosReport(
        run_dir=str(job.run_dir), plan=plan.to_dict(), faults=records, expected_final_step=expected_steps,
        final_step=final_step, exactly_once_problems=exactly_once, restores=restores,
        interrupted_snapshot_writes=interrupted, world_sizes=[g.start["world_size"] for g in groups],
        exit_codes={node.name: node.process.poll() for node in job.nodes}, ended=ended,
        seconds=round(time.time() - started_at, 1), problems=problems)


def newest_audited_steps(entries: list[dict[str, Any]]) -> dict[int, int]:
    """Per incarnation, the newest step that any of its ranks audited as committed."""
    newest: dict[int, int] = {}
    for entry in entries:
        newest[entry["incarnation"]] = max(newest.get(entry["incarnation"], entry["step"]), entry["step"])
    return newest


def _audited_before(restore: dict[str, Any], audited: dict[int, int]) -> int | None:
    """The newest step audited by the incarnation before the restore's (None: none audited)."""
    earlier = [incarnation for incarnation in audited if incarnation < restore["incarnation"]]
    return audited[max(earlier)] if earlier else None


def _trusted(restore: dict[str, Any], events: list[dict[str, Any]], audited: dict[int, int]) -> bool:
    """Whether a restore loaded a state the run had really reached (see the module docstring)."""
    if not restore.get("verified") and restore.get("source") != "live":
        return False
    earlier = [e for e in events if e["time"] < restore["time"]]
    if (restore.get("source") or "file") == "file":
        return any(e["event"] == schema.SNAPSHOT.name and (e["global_step"], e["checksum"]) ==
                   (restore["global_step"], restore["checksum"]) for e in earlier)
    committed = [e["global_step"] for e in earlier if e["event"] == schema.STEP.name]
    committed += [step for incarnation, step in audited.items() if incarnation < restore["incarnation"]]
    return bool(committed) and restore["global_step"] <= max(committed) + 1


def _lost_steps(restore: dict[str, Any], audited: dict[int, int]) -> int | None:
    """The committed steps a restore rolled back: by rank 0's log, or by the audit log where that
    says more (rank 0's newest `step` lines die with it when it is SIGKILLed)."""
    logged = restore.get("lost_steps")
    newest = _audited_before(restore, audited)
    if newest is None:
        return logged
    return max(logged or 0, newest - restore["global_step"])


def _lost_steps_problems(records: list[FaultRecord], restores: list[dict[str, Any]],
                         whole_job_nodes: frozenset[str]) -> list[str]:
    """A problem for each fault whose next restore redid more than MAX_LOST_STEPS committed steps."""
    problems = []
    for record in records:
        if not record.fired or record.node in whole_job_nodes:
            continue
        following = next((r for r in restores if r["time"] > record.fired_at), None)
        lost = following["lost_steps"] if following else None
        if lost is not None and lost > MAX_LOST_STEPS:
            problems.append(f"fault {record.index} ({record.description}) cost {lost} committed steps (the restore "
                            f"of step {following['global_step']} from {following['source']}); at most "
                            f"{MAX_LOST_STEPS} expected")
    return problems


def _recovery_seconds(record: FaultRecord, groups: list[WorkerGroup]) -> float | None:
    """Seconds from the fault to the first step of the first group that reflects it."""
    after = [g for g in groups if g.started >= record.fired_at and g.first_step is not None]
    if record.fault["action"] == "add_node":
        after = [g for g in after if record.pid in g.agent_pids]
    elif record.fault["action"] not in (*REMOVING_ACTIONS, "kill_worker"):
        return None
    return round(after[0].first_step["time"] - record.fired_at, 3) if after else None
