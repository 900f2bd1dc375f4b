"""Sharded training (`--sharding fsdp`) with real torchrun nodes on 127.0.0.1 and real gloo, through
kills, joins and a freeze at world sizes 1 to 4: a node SIGKILLed (the shards of 2 ranks resharded
over 1, from the survivor's memory: its own part and the copy of the lost rank's, so no committed
step is lost), three nodes joining (1 over 4, the parts served from memory to the new ranks), a node
SIGSTOPped (left behind by the peer watchdog; 4 over 3 from memory); every sample exactly once, and
the final model that of an uninterrupted, unsharded run. The job is held (elastic_ddp/chaos/held_train.py)
so that the scenario never races training.
The nodes have one worker or two: the buddy ring (elastic_ddp/snapshot/sharded/ring.py) spans nodes
of unequal sizes in world 4. Plain torchrun with `--rdzv_backend=elastic-c10d`, as docs/sharding.md runs it.

    .venv/bin/python -m pytest -q tests/cluster/test_sharded_cluster.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from elastic_ddp import load_snapshot
from elastic_ddp.agent.rendezvous.c10d import BACKEND_NAME
from elastic_ddp.chaos.equivalence import run_reference
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.snapshot.sharded import step_directories as steps
from elastic_ddp.snapshot.sharded.safe_reader import read_tensors
from elastic_ddp.testbed.local_cluster import STOCK_LAUNCHER
from tests.support.cluster import (
    REPO,
    assert_exactly_once,
    hold_settings,
    node_logs,
    pause_at,
    release,
    world_reached,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DATASET, BATCH, EPOCHS = 768, 32, 2
STEPS = EPOCHS * DATASET // BATCH
TRAINING_ARGS = ["--model", "mlp", "--epochs", str(EPOCHS), "--dataset_size", str(DATASET),
                 "--global_batch_size", str(BATCH), "--micro_batch_size", "16", "--snapshot_every_steps", "4",
                 "--log_interval", "4"]
DOCS = REPO / "docs"
PARAMETER_TOLERANCE = 1e-4  # world sizes 2, 1, 4, 3 sum the gradients in other orders (as tests/cluster/test_zero_loss.py)


def test_a_sharded_job_reshards_through_kills_joins_and_a_freeze_at_world_sizes_1_to_4(local_jobs, tmp_path):
    """2 -> 1 (SIGKILL), 1 -> 4 (a node of two workers and one of one join, through 2 or 3 if they come
    apart), 4 -> 3 (the one-worker node SIGSTOPped: the peer watchdog leaves it behind), every restore
    from memory with 0 steps lost. Nodes of unequal sizes: the buddy ring (snapshot/sharded/ring.py)
    must still put every part's copy on another node in world 4."""
    hold = tmp_path / "hold"
    # docs/sharding.md's command: plain torchrun, --rdzv_backend=elastic-c10d and its own defaults.
    job = local_jobs(launcher=STOCK_LAUNCHER, rdzv_backend=BACKEND_NAME, rdzv_conf=None, monitor_interval=None,
                     training_args=[*TRAINING_ARGS, "--sharding", "fsdp"], nproc_per_node=1, **hold_settings(hold))
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted run trains meanwhile (the job waits much)
        reference = pool.submit(run_reference, tmp_path / "reference", TRAINING_ARGS)
        host = job.add_node("host")
        lost = job.add_node("lost")
        world_reached(job, 2)
        job.wait_for_step(6, timeout=90)
        lost.kill()
        shrunk = job.wait_for_event(lambda e: e["event"] == "restore" and e["world_size"] == 1, 90, "restore in world 1")
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
        release(hold)
        assert host.wait(timeout=180) == 0, node_logs(job)
        assert pair.wait(timeout=60) == 0, node_logs(job)
        expected = load_snapshot(reference.result())["model"]

    restores = job.events("restore")
    assert {e["world_size"] for e in job.events("start")} == {1, 2, 3, 4}
    assert (shrunk["previous_world_size"], thinned["previous_world_size"]) == (2, 4), restores
    assert grown["previous_world_size"] in (1, 2, 3), grown
    # Zero loss at every change: each lost part was in another node's memory (its buddy's copy).
    assert all((e["source"], e["lost_steps"]) == ("memory", 0) for e in restores), restores
    # A kill during a step's exchange: that step never counted, and only it may be refused.
    assert all(item["global_step"] == shrunk["global_step"] + 1 for item in shrunk["refused"]), shrunk
    assert thinned["global_step"] == grown["global_step"] + 2, thinned  # frozen while paused: nothing in flight
    assert "peer watchdog: rank(s)" in host.log_text() + pair.log_text()
    assert_exactly_once(job, DATASET, EPOCHS, BATCH)
    (final_step, newest), *_ = steps.committed_steps(job.checkpoint_dir)
    assert final_step == STEPS
    sharded = {name[len("model."):]: value for name, value in read_tensors(newest).items()
               if name.startswith("model.")}
    assert sharded.keys() == expected.keys()
    difference = max((sharded[name] - value).abs().max().item() for name, value in expected.items())
    assert difference <= PARAMETER_TOLERANCE, f"largest parameter difference {difference:g}"


def test_a_users_model_trains_sharded_from_the_command_line(tmp_path):
    """docs/examples/digits.toml (a user's model, data, loss and AdamW by import path), sharded over
    two ranks, with evaluation (a collective in sharded mode: every rank forwards alike)."""
    checkpoint_dir = tmp_path / "ck"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "elastic_ddp.train", "--config", str(DOCS / "examples" / "digits.toml"), "--sharding", "fsdp",
               "--epochs", "3", "--checkpoint_dir", str(checkpoint_dir), "--progress", "log"]
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
