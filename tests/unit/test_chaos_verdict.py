"""The chaos verdict (elastic_ddp/chaos/verdict.py) on hand-written event logs, without any agent:
which restores it trusts, and how many committed steps it lets a fault cost.

    .venv/bin/python -m pytest -q tests/unit/test_chaos_verdict.py
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from elastic_ddp.chaos.harness import ChaosHarness
from elastic_ddp.chaos.plan import FaultPlan
from elastic_ddp.chaos.verdict import ChaosReport, FaultRecord

START = {"event": "start", "world_size": 1, "ranks": [{"rank": 0, "pid": 1, "agent_pid": 2}]}
VERIFIED_RESTORE = {"event": "restore", "verified": True}


def verdict_on(tmp_path, lines: list[dict], faults: Sequence[FaultRecord] = ()) -> ChaosReport:
    """The harness's verdict on a one-node run that left `lines` as its event log (and no audit log)."""
    args = ["--model", "mlp", "--epochs", "1", "--dataset_size", "128", "--global_batch_size", "64"]
    harness = ChaosHarness(tmp_path / "run", args, FaultPlan((), initial_nodes=1))
    harness.job.checkpoint_dir.mkdir(parents=True)
    harness.job.event_log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return harness._report(list(faults), [])


def test_the_report_flags_a_restore_of_a_snapshot_whose_write_never_completed(tmp_path):
    """The check behind "no torn snapshot was ever loaded"."""
    report = verdict_on(tmp_path, [
        {"time": 1.0, "incarnation": 1, **START},
        {"time": 1.1, "incarnation": 1, "event": "snapshot_captured", "global_step": 1},
        {"time": 1.2, "incarnation": 1, "event": "snapshot", "global_step": 1, "checksum": "blake3:aaa"},
        {"time": 1.3, "incarnation": 1, "event": "snapshot_captured", "global_step": 2},  # killed mid-write
        {"time": 5.0, "incarnation": 2, **START},
        {"time": 5.1, "incarnation": 2, **VERIFIED_RESTORE, "global_step": 1, "checksum": "blake3:aaa"},
        {"time": 5.2, "incarnation": 2, **VERIFIED_RESTORE, "global_step": 2, "checksum": "blake3:bbb"},
        {"time": 6.0, "incarnation": 2, "event": "finished", "global_step": 2},
    ])
    assert [r["trusted"] for r in report.restores] == [True, False]
    assert report.interrupted_snapshot_writes == [2]
    assert any("restore of step 2 (checksum blake3:bbb" in problem for problem in report.problems)
    assert any(problem.startswith("exactly once") for problem in report.problems)  # no audit log here
    assert not report.ok


def test_the_report_trusts_memory_restores_of_committed_steps_and_counts_lost_steps(tmp_path):
    """A memory restore may be one step past rank 0's log (the step rank 0 died in), not more; a
    fault may cost one committed step, not more."""
    memory = {**VERIFIED_RESTORE, "checksum": "blake3:ccc", "source": "memory"}
    faults = [FaultRecord(index, "kill_node random", {"action": "kill_node"}, fired=True, fired_at=at, node=node)
              for index, (at, node) in enumerate([(4.0, "node1"), (6.0, "node1"), (8.0, "node1")])]
    report = verdict_on(tmp_path, [
        {"time": 1.0, "incarnation": 1, **START},
        *({"time": 1.0 + step / 10, "incarnation": 1, "event": "step", "global_step": step} for step in (1, 2, 3)),
        {"time": 5.0, "incarnation": 2, **START},
        {"time": 5.1, "incarnation": 2, **memory, "global_step": 4, "lost_steps": 0},
        {"time": 7.0, "incarnation": 3, **START},
        {"time": 7.1, "incarnation": 3, **memory, "global_step": 9, "lost_steps": 0},
        {"time": 9.0, "incarnation": 4, **START},
        {"time": 9.1, "incarnation": 4, **memory, "global_step": 1, "lost_steps": 2},
    ], faults)
    assert [(r["source"], r["trusted"]) for r in report.restores] == [("memory", True), ("memory", False),
                                                                       ("memory", True)]
    assert "restore of step 9 from memory is not a verified copy of a committed step" in report.problems
    assert [p for p in report.problems if "committed steps" in p] == [
        "fault 2 (kill_node random) cost 2 committed steps (the restore of step 1 from memory); at most 1 expected"]


def test_the_audit_log_tells_the_steps_that_a_sigkilled_rank_0_never_wrote_to_its_event_log(tmp_path):
    """Rank 0 batches its `step` lines (runlog/events.py): SIGKILLed, it took steps 3 to 5 along.
    The ranks' audit lines still show them: the memory restore of step 5 is trusted (by the log alone
    it would not be), and the file restore of step 2 after the next fault rolled back the 5 steps to
    step 7 that incarnation 2 had committed, whatever rank 0's log said."""
    audit_dir = tmp_path / "run" / "audit"
    audit_dir.mkdir(parents=True)
    for incarnation, steps in ((1, range(1, 6)), (2, range(6, 8))):
        (audit_dir / f"audit-{incarnation}-rank1.jsonl").write_text("".join(
            json.dumps({"incarnation": incarnation, "epoch": 0, "step": step, "rank": 1, "world_size": 2,
                        "samples": [step]}) + "\n" for step in steps))
    faults = [FaultRecord(index, "kill_node random", {"action": "kill_node"}, fired=True, fired_at=at, node="node0")
              for index, at in enumerate((4.0, 6.5))]
    report = verdict_on(tmp_path, [
        {"time": 1.0, "incarnation": 1, **START},
        *({"time": 1.0 + step / 10, "incarnation": 1, "event": "step", "global_step": step} for step in (1, 2)),
        {"time": 1.25, "incarnation": 1, "event": "snapshot", "global_step": 2, "checksum": "blake3:ddd"},
        {"time": 5.0, "incarnation": 2, **START},
        {"time": 5.1, "incarnation": 2, **VERIFIED_RESTORE, "source": "memory", "checksum": "blake3:eee",
         "global_step": 5, "lost_steps": 0},
        {"time": 7.0, "incarnation": 3, **START},
        {"time": 7.1, "incarnation": 3, **VERIFIED_RESTORE, "source": "file", "checksum": "blake3:ddd",
         "global_step": 2, "lost_steps": 0},
    ], faults)
    assert [(r["source"], r["trusted"], r["lost_steps"]) for r in report.restores] == [
        ("memory", True, 0), ("file", True, 5)]
    assert [p for p in report.problems if "committed steps" in p] == [
        "fault 1 (kill_node random) cost 5 committed steps (the restore of step 2 from file); at most 1 expected"]


def test_the_report_trusts_the_survivors_own_state_of_a_committed_step_when_they_re_formed_in_process(tmp_path):
    """`live` (issue 44): nothing was copied, so there is no checksum to verify; the step must still
    be one the run had committed."""
    live = {"event": "restore", "verified": False, "checksum": None, "source": "live"}
    report = verdict_on(tmp_path, [
        {"time": 1.0, "incarnation": 1, **START},
        *({"time": 1.0 + step / 10, "incarnation": 1, "event": "step", "global_step": step} for step in (1, 2, 3)),
        {"time": 5.0, "incarnation": 2, **START, "in_process": True},
        {"time": 5.1, "incarnation": 2, **live, "global_step": 3, "lost_steps": 0},
        {"time": 7.0, "incarnation": 3, **START, "in_process": True},
        {"time": 7.1, "incarnation": 3, **live, "global_step": 9, "lost_steps": 0},
    ])
    assert [(r["source"], r["trusted"]) for r in report.restores] == [("live", True), ("live", False)]
    assert "restore of step 9 from memory is not a verified copy of a committed step" in report.problems
    assert "2 restores (0 from memory, 2 kept in process)" in report.summary()
