"""Zero-loss recovery: a lost, joining or dying peer costs the survivors no committed step.

Real torchrun agents as nodes on 127.0.0.1, real gloo, real SIGKILLs. Snapshot files are written
only at epoch ends (`--snapshot_every_steps 0`), so a restore that loses nothing can only come from
the memory copies the survivors keep (elastic_ddp/snapshot/memory_copies.py); each node has its own
memory directory, as separate machines would. Every test checks exactly-once in the audit log and
the final parameters against one uninterrupted process (MLP, within 1e-4).
"""

from __future__ import annotations

import json
import time

import pytest

from elastic_ddp.agent.rendezvous.boards.c10d import BACKEND_NAME
from elastic_ddp.chaos.equivalence import DEFAULT_LOSS_TOLERANCE, compare_runs
from elastic_ddp.chaos.held_train import pace
from elastic_ddp.testbed.local_cluster import STOCK_LAUNCHER, LocalJob, wait_for
from tests.support.cluster import (
    EXTRA_TRAINING_ARGS,
    FAULT_MODULE,
    assert_exactly_once,
    hold_settings,
    node_logs,
    pause_at,
    release,
    world_reached,
)
from tests.support.fault_switch import FAULT_VARIABLE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DATASET, BATCH, EPOCHS = 1536, 64, 3
STEPS_PER_EPOCH = DATASET // BATCH  # 24
TRAINING_ARGS = ["--model", "mlp", "--no-augment", "--lr", "0.01", "--epochs", str(EPOCHS),
                 "--dataset_size", str(DATASET), "--global_batch_size", str(BATCH), "--micro_batch_size", "16",
                 "--snapshot_every_steps", "0", "--log_interval", "1"]
PARAMETER_TOLERANCE = 1e-4  # the bound; chaos/equivalence.py explains why not bit equality


def restore_after(job: LocalJob, world_size: int, after: float, timeout: float = 120) -> dict:
    return job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == world_size
                              and e["time"] > after, timeout, f"a restore in world {world_size}")


def assert_same_model_as_uninterrupted(job: LocalJob, reference, may_lack_a_loss: set[int]) -> None:
    """Final parameters and every step's loss as one uninterrupted process had them. A step
    committed just before a rank died may lack its loss: its reduction needed the dead rank."""
    equivalence = compare_runs(reference, job.checkpoint_dir)
    assert set(equivalence.missing_steps) <= may_lack_a_loss, equivalence.describe()
    assert equivalence.parameter_difference <= PARAMETER_TOLERANCE, equivalence.describe()
    assert equivalence.loss_difference <= DEFAULT_LOSS_TOLERANCE, equivalence.describe()


def audit_lines(job: LocalJob, incarnation: int, rank: int) -> list[dict]:
    path = job.audit_dir / f"audit-{incarnation}-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_from_memory_losing_nothing(restore: dict, committed: int, in_process: bool = False) -> None:
    """From the survivors' memory: their copies after a restart, or their own state when they
    re-formed the group in process (tests/cluster/test_in_process.py)."""
    assert restore["source"] == ("live" if in_process else "memory") and restore["file"] is None, restore
    assert restore["global_step"] >= committed, (restore, committed)
    assert restore["lost_steps"] == 0 and (in_process or restore["verified"]), restore


def seconds_to_first_step(job: LocalJob, restore: dict, since: float) -> float:
    step = job.wait_for_event(lambda e: e["event"] == "step" and e["incarnation"] == restore["incarnation"], 60,
                              "the first step after the restore")
    return step["time"] - since


def test_a_lost_node_a_join_and_a_worker_killed_inside_a_step_cost_no_committed_step(local_jobs, tmp_path,
                                                                                      reference_runs):
    """Plain torchrun with `--rdzv_backend=elastic-c10d` and nothing else (the README's command),
    one job. A node is killed mid-epoch (world 4 -> 2; the survivors re-form the group in their own
    processes, keeping their own state: issue 44) and a node joins (2 -> 4, in process too): the
    survivors lose no committed step. Then rank 3 SIGKILLs itself twice. In step 55, inside the gradient
    all-reduce: nobody can finish step 55, the survivors keep step 54. Then in step 65 of the next
    group, once every other rank has committed step 65: they keep 65, and write rank 3's audit line
    for it, which rank 3 never wrote."""
    hold, fired = tmp_path / "hold", {step: tmp_path / f"fault-fired-{step}" for step in (55, 65)}
    settings = hold_settings(hold)
    settings["module"] = FAULT_MODULE
    settings["env"][FAULT_VARIABLE] = (f"rank=3,step=55,at=allreduce,once={fired[55]};"
                                       f"rank=3,step=65,at=after_allreduce,once={fired[65]}")
    job = local_jobs(launcher=STOCK_LAUNCHER, rdzv_backend=BACKEND_NAME, rdzv_conf=None, monitor_interval=None,
                     training_args=TRAINING_ARGS, nproc_per_node=2, **settings)
    host = job.add_node("host")
    lost = job.add_node("lost")
    world_reached(job, 4)
    reference = reference_runs([*TRAINING_ARGS, *EXTRA_TRAINING_ARGS])  # trains while the job is paced
    job.wait_for_step(STEPS_PER_EPOCH + 6, timeout=120)  # mid-epoch: the newest file is of step 24
    killed_at = time.time()
    lost.kill()
    committed = job.last_step()  # rank 0 is on host: it commits no step after the kill but the one in flight
    after_kill = restore_after(job, 2, killed_at)
    assert_from_memory_losing_nothing(after_kill, committed, in_process=True)  # plain DDP over gloo: issue 44
    print(f"kill -> first step without the node: {seconds_to_first_step(job, after_kill, killed_at):.1f} s")
    assert after_kill["global_step"] % STEPS_PER_EPOCH, "a mid-epoch step: no snapshot file holds it"

    paused = after_kill["global_step"] + 3  # a join takes seconds: the job waits there for it
    pause_at(hold, paused)
    job.wait_for_step(paused, timeout=60)
    joined_at = time.time()
    joiner = job.add_node("joiner")
    after_join = restore_after(job, 4, joined_at)
    assert_from_memory_losing_nothing(after_join, paused)  # the survivors' kept step, served to the joiner
    grown = next(e for e in job.events("start") if e["incarnation"] == after_join["incarnation"])
    assert grown["in_process"] is True, ("the survivors let the joiner in without a restart", grown)
    print(f"join -> first step with the node: {seconds_to_first_step(job, after_join, joined_at):.1f} s")
    assert after_join["global_step"] < 55, "the worker faults come after the join, in the world of 4"

    pace(hold)  # on to the worker faults, in the world of 4 again
    restores = {}
    for step in (55, 65):
        wait_for(fired[step].exists, 120, f"the fault in step {step}", still_possible=job.why_ended)
        restores[step] = restore_after(job, 4, fired[step].stat().st_mtime)
    release(hold)
    assert host.wait(timeout=180) == 0 and joiner.wait(timeout=60) == 0, node_logs(job)

    for step, committed_step, moment in ((55, 54, "allreduce"), (65, 65, "after_allreduce")):
        restore = restores[step]
        assert_from_memory_losing_nothing(restore, committed_step)
        assert restore["global_step"] == committed_step, "the state the survivors had committed, no other"
        fired_at = fired[step].stat().st_mtime
        died_in = max((e for e in job.events("start") if e["time"] < fired_at), key=lambda e: e["time"])["incarnation"]
        in_step = {rank: [entry for entry in audit_lines(job, died_in, rank) if entry["step"] == step]
                   for rank in range(4)}
        assert not in_step[3], f"rank 3 died before it committed step {step}"
        recorded_for_rank_3 = [entry for rank in (0, 1, 2) for entry in in_step[rank] if entry["rank"] == 3]
        assert bool(recorded_for_rank_3) == (moment == "after_allreduce"), in_step
    assert_exactly_once(job, DATASET, EPOCHS, BATCH)
    assert_same_model_as_uninterrupted(job, reference.result(timeout=300),
                                       may_lack_a_loss={after_kill["global_step"], 65})
    logs = "\n".join(node.log_text() for node in job.nodes)
    assert f"resumed from step {after_kill['global_step']} (epoch 2/3) from the survivors' own state" in logs
    assert "drain requested" not in logs
