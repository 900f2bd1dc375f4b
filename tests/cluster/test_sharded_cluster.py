"""Sharded training (`--sharding fsdp`) with real torchrun nodes on 127.0.0.1 and real gloo, through
kills, joins, a freeze and a drain at world sizes 1 to 4 (the kill and the joins taken in the
running workers' processes where they can be, torchrun's restart otherwise): a node SIGKILLed (the shards of 2 ranks
resharded over 1, from the survivor's memory: its own part and the copy of the lost rank's, so no
committed step is lost), three nodes joining (1 over 4, the parts served from memory to the new
ranks), a node SIGSTOPped (left behind by the peer watchdog; 4 over 3 from memory), a node drained
by SIGTERM (3 over 1 after a final committed step and its durable snapshot); every sample exactly
once, and the final model that of an uninterrupted, unsharded run and of an uninterrupted FSDP run.
On the same run: `elastic-ddp report` and the live metrics endpoint count its restores, world sizes
and lost steps (0). The job is held (elastic_ddp/chaos/held_train.py) so that the scenario never
races training.
The nodes have one worker or two: the buddy ring (elastic_ddp/snapshot/sharded/ring.py) spans nodes
of unequal sizes in world 4. Plain torchrun with `--rdzv_backend=elastic-c10d`, as docs/sharding.md runs it.

    .venv/bin/python -m pytest -q tests/cluster/test_sharded_cluster.py
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from elastic_ddp.agent.rendezvous.boards.c10d import BACKEND_NAME
from elastic_ddp.chaos.equivalence import compare_runs, run_reference
from elastic_ddp.runlog.metrics_node import read_endpoint
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.snapshot.sharded import step_directories as steps
from elastic_ddp.testbed.local_cluster import STOCK_LAUNCHER, LocalJob, wait_for
from elastic_ddp.tools import cli
from tests.support.cluster import (
    EXTRA_TRAINING_ARGS,
    REPO,
    assert_exactly_once,
    hold_settings,
    node_logs,
    pause_at,
    release,
    world_reached,
)
from tests.support.metrics import scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DATASET, BATCH, EPOCHS = 768, 32, 2
STEPS = EPOCHS * DATASET // BATCH
TRAINING_ARGS = ["--model", "mlp", "--epochs", str(EPOCHS), "--dataset_size", str(DATASET),
                 "--global_batch_size", str(BATCH), "--micro_batch_size", "16", "--snapshot_every_steps", "4",
                 "--log_interval", "1"]  # a loss per step, compared with the uninterrupted run's
DOCS = REPO / "docs"
# Relative to each tensor's largest value; and per-step losses: world sizes 2, 1, 4, 3 sum the gradients in
# other orders (as tests/cluster/test_zero_loss.py; measured here: 2e-7 and 1.2e-7).
PARAMETER_TOLERANCE = 1e-4
# Steps the job may train past world 3 before it stops again: the drain's votes (about every 0.25 s,
# runtime/drain.py) must agree before then, or the draining ranks would wait on a paused host.
DRAIN_MARGIN = 16
P = "elastic_ddp_"


def node_metrics(job: LocalJob, node: str) -> dict[str, float]:
    """The samples of `node`'s metrics endpoint by name (`name{label="value"}` for a labelled one)."""
    endpoint = next(e for d in job.node_memory_dir(node).glob("elastic_ddp-metrics-*") if (e := read_endpoint(d)))
    return scrape(endpoint.url)


def test_a_sharded_job_reshards_through_kills_joins_and_a_freeze_at_world_sizes_1_to_4(local_jobs, tmp_path, capsys):
    """2 -> 1 (SIGKILL), 1 -> 4 (a node of two workers and one of one join, through 2 or 3 if they come
    apart), 4 -> 3 (the one-worker node SIGSTOPped: the peer watchdog leaves it behind), 3 -> 1 (the
    node of two workers drained by SIGTERM to its agent), every restore with 0 steps lost, from memory
    but for the drain's (its final durable snapshot: a part and its copy left with the node). Nodes of unequal sizes: the buddy ring
    (snapshot/sharded/ring.py) must still put every part's copy on another node in world 4."""
    hold = tmp_path / "hold"
    # docs/sharding.md's command: plain torchrun, --rdzv_backend=elastic-c10d and its own defaults.
    job = local_jobs(launcher=STOCK_LAUNCHER, rdzv_backend=BACKEND_NAME, rdzv_conf=None, monitor_interval=None,
                     training_args=[*TRAINING_ARGS, "--sharding", "fsdp", "--metrics_port", "0"], nproc_per_node=1,
                     **hold_settings(hold))
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted run trains meanwhile (the job waits much)
        reference = pool.submit(run_reference, tmp_path / "reference", TRAINING_ARGS)
        host = job.add_node("host")
        lost = job.add_node("lost")
        # The host may train alone first (world 1), the second node joining it when its server is ready.
        pair_of_two = world_reached(job, 2)
        job.wait_for_event(lambda e: e["event"] == "step" and e["incarnation"] == pair_of_two["incarnation"]
                           and e["global_step"] >= 6, 90, "a step in world 2")
        killed_at = time.time()
        lost.kill()
        shrunk = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 1 and e["time"] > killed_at,
                                    90, "restore in world 1")
        pause_at(hold, shrunk["global_step"] + 2)  # the joins happen mid-epoch, however fast the job trains
        pair = job.add_node("pair", agent_args=["--nproc_per_node=2"])  # the last one wins
        single = job.add_node("single")
        grown = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 4, 120, "restore in world 4")
        pause_at(hold, grown["global_step"] + 2)  # two steps in world 4 (parts exchanged among 4), then a freeze
        job.wait_for_event(lambda e: e["event"] == "step" and e["incarnation"] == grown["incarnation"]
                           and e["global_step"] == grown["global_step"] + 2, 90, "two steps in world 4")
        frozen_at = time.time()
        single.freeze()
        thinned = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 3
                                     and e["time"] > frozen_at, 90, "restore in world 3 without the frozen node")
        single.kill()
        pause_at(hold, thinned["global_step"] + DRAIN_MARGIN)  # the host's rank trains on while the ranks vote
        drained_at = time.time()
        pair.terminate()  # SIGTERM to the agent, as a spot-instance notice
        drain = job.wait_for_event(lambda e: e["event"] == "drain" and e["time"] > drained_at, 60, "the drain")
        alone = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 1
                                   and e["time"] > drain["time"], 90, "restore in world 1 after the drain")
        assert pair.wait(timeout=60) != 0, "a drained node's agent ends on the signal"
        # Rank 0's node serves the run's metrics while the job is held after the drain.
        restores = job.events("restore")
        starts = job.events("start")
        metrics: dict[str, float] = {}

        def shows_every_group() -> bool:
            metrics.update(node_metrics(job, "host"))
            return metrics.get(f"{P}incarnations_total") == len(starts)

        wait_for(shows_every_group, 30, "the metrics of the group after the drain")
        release(hold)
        assert host.wait(timeout=180) == 0, node_logs(job)
        reference.result()

    assert {e["world_size"] for e in starts} == {1, 2, 3, 4}
    # With our rendezvous the kill and the joins are taken in the running workers' processes, the model
    # sharded again over each new group (training/in_process.py): a group started in process holds the
    # host's worker of the group before it. (Which changes are in process depends on where each one
    # lands: a kill inside a durable snapshot's collectives, or the freeze while the job is paused
    # between steps, takes torchrun's restart; this run must show at least one in process.)
    in_process = [(before, after) for before, after in itertools.pairwise(starts) if after["in_process"]]
    assert in_process, [(e["world_size"], e["in_process"]) for e in starts]
    for before, after in in_process:
        host_workers = [{rank["pid"] for rank in e["ranks"] if rank["agent_pid"] == host.pid} for e in (before, after)]
        assert host_workers[0] == host_workers[1], ("the host's worker kept its process", before, after)
    assert (shrunk["previous_world_size"], thinned["previous_world_size"]) == (2, 4), restores
    assert grown["previous_world_size"] in (1, 2, 3), grown
    # Zero loss at every change: each lost part was in another node's memory (its buddy's copy); the
    # drained node left after a final committed step, its shards in a durable snapshot.
    assert all(e["lost_steps"] == 0 for e in restores), restores
    assert all(e["source"] == "memory" for e in restores if e["incarnation"] != alone["incarnation"]), restores
    assert drain["snapshot_durable"] is True, drain
    # In world 3 the node of two holds one part and its copy (more than half of the ranks, ring.py): with
    # it gone, that step's memory state is refused with its reason and its durable snapshot taken.
    assert (alone["previous_world_size"], alone["global_step"], alone["source"]) == (3, drain["global_step"], "file")
    assert [(item["global_step"], "a part and its copy were both lost" in item["reason"]) for item in alone["refused"]
            ] == [(drain["global_step"], True)], alone
    # A kill during a step's exchange: that step never counted, and only it may be refused.
    assert all(item["global_step"] == shrunk["global_step"] + 1 for item in shrunk["refused"]), shrunk
    assert thinned["global_step"] == grown["global_step"] + 2, thinned  # frozen while paused: nothing in flight
    assert "peer watchdog: rank(s)" in host.log_text() + pair.log_text()
    assert_exactly_once(job, DATASET, EPOCHS, BATCH)
    (final_step, _), *_ = steps.committed_steps(job.checkpoint_dir)
    assert final_step == STEPS
    # The chaos harness's check, which reads the newest sharded step: the final parameters and the loss
    # of every step against the uninterrupted, unsharded run. (An uninterrupted FSDP run equals that
    # run: tests/unit/test_chaos_equivalence.py.)
    equivalence = compare_runs(reference.result(), job.checkpoint_dir)
    assert equivalence.parameter_difference <= PARAMETER_TOLERANCE, equivalence.describe()
    assert equivalence.loss_difference <= PARAMETER_TOLERANCE, equivalence.describe()
    # (a step logged by no group: one a group restored from and did not train again)
    assert set(equivalence.missing_steps) <= {e["global_step"] for e in restores}, equivalence.describe()
    assert equivalence.steps_compared + len(equivalence.missing_steps) == STEPS, equivalence.describe()

    # The live metrics of the sharded run, on rank 0's node: every restore, and why each group started.
    assert (metrics[f"{P}world_size"], metrics[f"{P}lost_steps_total"], metrics[f"{P}last_recovery_lost_steps"]) == (
        1, 0, 0), metrics
    for source in ("memory", "file"):
        assert metrics.get(f'{P}restores_total{{source="{source}"}}', 0) == sum(
            e["source"] == source for e in restores), (source, metrics)
    causes = {name: value for name, value in metrics.items() if name.startswith(f"{P}restarts_total")}
    assert sum(causes.values()) == len(starts) - 1, causes
    assert causes[f'{P}restarts_total{{cause="drain"}}'] == 1 and causes[f'{P}restarts_total{{cause="node_lost"}}'] >= 1
    assert metrics[f"{P}global_step"] >= alone["global_step"], metrics

    # `elastic-ddp report` on the run's event log.
    assert cli.main(["report", str(job.checkpoint_dir), "--json", "--no-plot"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["finished"], report["final_step"], report["epochs_completed"]) == (True, STEPS, EPOCHS)
    assert [w["world_size"] for w in report["world_sizes"]] == [e["world_size"] for e in starts]
    assert (report["restores"], report["lost_steps_total"], report["drains"], report["failures"]) == (
        len(restores), 0, 1, 2), report["transitions"]
    drained = next(t for t in report["transitions"] if t["kind"] == "node drained")
    assert (drained["from_world_size"], drained["to_world_size"], drained["resumed_from_step"],
            drained["lost_steps"]) == (3, 1, drain["global_step"], 0), drained


def test_a_users_model_trains_sharded_from_the_command_line(tmp_path):
    """docs/examples/digits.toml (a user's model, data, loss and AdamW by import path), sharded over
    two ranks, with evaluation (a collective in sharded mode: every rank forwards alike)."""
    checkpoint_dir = tmp_path / "ck"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "elastic_ddp.train", "--config", str(DOCS / "examples" / "digits.toml"), "--sharding", "fsdp",
               "--epochs", "3", "--checkpoint_dir", str(checkpoint_dir), "--progress", "log",
               # On a GPU machine (tests/run_cuda.sh) both ranks share the one GPU through gloo.
               *EXTRA_TRAINING_ARGS]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False,
                            env={**os.environ, "OMP_NUM_THREADS": "1",
                                 "PYTHONPATH": os.pathsep.join(filter(None, [str(DOCS / "examples"), str(REPO),
                                                                  os.environ.get("PYTHONPATH")]))})
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [event for event in read_events(checkpoint_dir / "events.jsonl") if event["event"] == "eval"]
    assert evals and evals[-1]["samples"] == 360, evals
    assert evals[-1]["accuracy"] > 0.8, evals[-1]  # ten classes: far above chance after 3 epochs
    (final_step, _), *_ = steps.committed_steps(checkpoint_dir)
    assert final_step == evals[-1]["global_step"]
