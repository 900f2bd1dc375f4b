"""Survivors never restart (issue 44): a node lost or joining mid-epoch costs the running workers no process.

Real torchrun agents (stock torchrun, `--rdzv_backend=elastic-c10d`, the defaults: `in_process=1`)
as three nodes of two workers on 127.0.0.1, real gloo, a real SIGKILL of a whole node. The
survivors' workers catch the broken all-reduce, their agents run the next round for them while
torchrun sees healthy workers, and they re-form the group in their own processes
(elastic_ddp/training/in_process.py); a node that joins later is let in the same way, its
workers started by its torchrun and given the survivors' state. Snapshot files are written only at epoch ends, so a restore
that loses nothing comes from the survivors' memory; exactly once is read from the audit log, and
the model is compared with one uninterrupted process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from elastic_ddp.agent.rendezvous.boards.c10d import BACKEND_NAME
from elastic_ddp.chaos.equivalence import DEFAULT_LOSS_TOLERANCE, compare_runs
from elastic_ddp.chaos.held_train import pause_at
from elastic_ddp.handoff import rounds as round_handoff
from elastic_ddp.handoff.rounds import IN_PROCESS_ENV
from elastic_ddp.testbed.local_cluster import STOCK_LAUNCHER, free_port, signal_tree, wait_for
from tests.support.cluster import (
    EXTRA_TRAINING_ARGS,
    FAULT_MODULE,
    assert_exactly_once,
    hold_settings,
    node_logs,
    release,
    world_reached,
)
from tests.support.fault_switch import FAULT_VARIABLE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DATASET, BATCH, EPOCHS = 1536, 64, 2
STEPS_PER_EPOCH = DATASET // BATCH  # 24
TRAINING_ARGS = ["--model", "mlp", "--no-augment", "--lr", "0.01", "--epochs", str(EPOCHS),
                 "--dataset_size", str(DATASET), "--global_batch_size", str(BATCH), "--micro_batch_size", "16",
                 "--snapshot_every_steps", "0", "--log_interval", "1"]
PARAMETER_TOLERANCE = 1e-4  # as tests/cluster/test_zero_loss.py
RESTARTED = "will restart worker group"  # what torch's agent logs before it restarts its workers


def test_a_lost_node_and_a_joining_one_are_absorbed_by_the_survivors_workers_in_their_own_processes(
        local_jobs, tmp_path, reference_runs):
    hold = tmp_path / "hold"
    # Paced, and stopped before the last steps: the join below must come mid-epoch, before the end.
    join_at = 2 * STEPS_PER_EPOCH - 4
    job = local_jobs(TRAINING_ARGS, launcher=STOCK_LAUNCHER, rdzv_backend=BACKEND_NAME, rdzv_conf=None,
                     monitor_interval=None, nproc_per_node=2, **hold_settings(hold))
    pause_at(hold, join_at)
    survivors = [job.add_node("host"), job.add_node("other")]
    lost = job.add_node("lost")
    first = world_reached(job, 6)
    reference = reference_runs([*TRAINING_ARGS, *EXTRA_TRAINING_ARGS])  # trains while the job is held
    # Mid-epoch (the newest file is of step 24), and once the group of six trains: the first two
    # nodes may have trained without the third before it came. Past the group's second step, whose
    # forward rebuilds DDP's buckets in one blocking call (a loss there takes the restart path:
    # in_process.InterruptibleDDP).
    def third_step_of_six_mid_epoch() -> bool:
        steps = [e["global_step"] for e in job.events("step") if e["incarnation"] == first["incarnation"]]
        return len(steps) >= 3 and steps[-1] > STEPS_PER_EPOCH and steps[-1] % STEPS_PER_EPOCH > 2

    wait_for(third_step_of_six_mid_epoch, 120, "a third step of the group of six, mid-epoch",
             still_possible=lambda: None if all(node.is_running() for node in [*survivors, lost]) else "a node ended")
    killed_at = time.time()
    lost.kill()
    committed = job.last_step()
    start = job.wait_for_event(lambda e: e["event"] == "start" and e["world_size"] == 4 and e["time"] > killed_at,
                               60, "the group of the four survivors")
    assert start["in_process"] is True, start
    restore = job.wait_for_event(lambda e: e["event"] == "restore" and e["incarnation"] == start["incarnation"], 30,
                                 "the re-formed group's restore")
    assert restore["lost_steps"] == 0 and restore["global_step"] >= committed, (restore, committed)
    # `live` when every survivor held the same step (nothing loaded); a ring all-reduce broken at its
    # end lets some ranks commit a step the others did not: then the newest is served from memory.
    assert restore["source"] in ("live", "memory"), restore
    first_step = job.wait_for_event(lambda e: e["event"] == "step" and e["incarnation"] == start["incarnation"], 30,
                                    "the first step of the re-formed group")
    print(f"kill -> first step, in process: {first_step['time'] - killed_at:.2f} s")

    survivor_agents = {node.pid for node in survivors}
    before = {rank["pid"] for rank in first["ranks"] if rank["agent_pid"] in survivor_agents}
    after = {rank["pid"] for rank in start["ranks"]}
    assert len(before) == 4 and after == before, ("the survivors' workers are the same processes", first, start)
    assert sorted(rank["rank"] for rank in start["ranks"]) == [0, 1, 2, 3], start

    # A node joins: the survivors, stopped after step `join_at`, take it in process too.
    job.wait_for_event(lambda e: e["event"] == "step" and e["global_step"] >= join_at, 60, f"step {join_at}")
    joined_at = time.time()
    joiner = job.add_node("joiner")
    grown = job.wait_for_event(lambda e: e["event"] == "start" and e["world_size"] == 6 and e["time"] > joined_at,
                               90, "the group of the survivors and the joiner")
    assert grown["in_process"] is True, grown
    restored = job.wait_for_event(lambda e: e["event"] == "restore" and e["incarnation"] == grown["incarnation"], 30,
                                  "the grown group's restore")
    assert restored["lost_steps"] == 0 and restored["global_step"] >= join_at, restored
    grown_step = job.wait_for_event(lambda e: e["event"] == "step" and e["incarnation"] == grown["incarnation"], 30,
                                    "the first step of the grown group")
    print(f"join -> first step of the grown group: {grown_step['time'] - joined_at:.2f} s")
    still = {rank["pid"] for rank in grown["ranks"] if rank["agent_pid"] in survivor_agents}
    assert still == before, ("the survivors' workers are still the same processes", start, grown)
    assert sorted(rank["rank"] for rank in grown["ranks"]) == list(range(6)), grown

    release(hold)
    # torch's agents still count the lost node in their exit barrier (and the joiner's counts the
    # survivors, which hold an older round of torch's): without the handler's compensation they
    # would wait 300 s for them.
    assert all(node.wait(timeout=90) == 0 for node in [*survivors, joiner]), node_logs(job)
    for node in survivors:
        assert RESTARTED not in node.log_text(), node_logs(job)
    assert [e["world_size"] for e in job.events("start") if e["time"] >= first["time"]] == [6, 4, 6], \
        "the group of six, the survivors' group, the group with the joiner: no restart"
    assert_exactly_once(job, DATASET, EPOCHS, BATCH)
    equivalence = compare_runs(reference.result(timeout=300), job.checkpoint_dir)
    # A step committed just before the node died may lack its loss (its reduction needed the dead ranks).
    assert set(equivalence.missing_steps) <= {restore["global_step"]}, equivalence.describe()
    assert equivalence.parameter_difference <= PARAMETER_TOLERANCE, equivalence.describe()
    assert equivalence.loss_difference <= DEFAULT_LOSS_TOLERANCE, equivalence.describe()


# ------------------------------------------------------------------ the workers' side, agents played by the test

# A node's agent, as its workers see it: their parent process. It starts its worker once the test
# has published the round (a line on its stdin), and passes the worker's exit code on.
AGENT_STAND_IN = ("import subprocess, sys; sys.stdin.readline(); "
                  "sys.exit(subprocess.call(sys.argv[1:]))")


class StandInNode:
    """One worker under a stand-in agent whose handoff directory (elastic_ddp/handoff/rounds.py) the test writes."""

    def __init__(self, run_dir, group_rank: int, world_size: int, port: int, training_args: list[str], env: dict):
        self.group_rank = group_rank
        self.log_path = run_dir / f"node{group_rank}.log"
        worker_env = {**os.environ, **env, "RANK": str(group_rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size),
                      "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(group_rank), "GROUP_WORLD_SIZE": str(world_size),
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "stand-in",
                      IN_PROCESS_ENV: "1", "OMP_NUM_THREADS": "1",
                      "TMPDIR": tempfile.gettempdir()}  # where this process writes the handoff directory
        command = [sys.executable, "-c", AGENT_STAND_IN, sys.executable, "-m", FAULT_MODULE, *training_args,
                   "--memory_dir", str(run_dir / f"memory{group_rank}")]
        with open(self.log_path, "wb") as log:
            self.agent = subprocess.Popen(command, env=worker_env, stdin=subprocess.PIPE, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=run_dir,
                                          start_new_session=True)  # signal_tree kills its process group
        round_handoff.open_handoff(self.agent.pid)

    def announce(self, announcement: round_handoff.RoundAnnouncement) -> None:
        round_handoff.publish_round(self.agent.pid, announcement)

    def go(self) -> None:
        self.agent.stdin.write(b"go\n")
        self.agent.stdin.close()

    def requests(self) -> dict:
        return round_handoff.reform_requests(self.agent.pid)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        signal_tree(self.agent.pid, signal.SIGKILL)
        self.agent.wait(timeout=30)
        round_handoff.close_handoff(self.agent.pid)


@pytest.fixture
def stand_in_nodes(tmp_path):
    nodes: list[StandInNode] = []

    def start(count: int, training_args: list[str], env: dict) -> list[StandInNode]:
        port = free_port()
        nodes.extend(StandInNode(tmp_path, rank, count, port, training_args, env) for rank in range(count))
        for node in nodes:
            node.announce(round_handoff.RoundAnnouncement(0, node.group_rank, count, "127.0.0.1", port, False,
                                                          "started by the test"))
            node.go()
        return nodes

    yield start
    for node in nodes:
        node.stop()


def stand_in_args(tmp_path) -> list[str]:
    return [*TRAINING_ARGS, *EXTRA_TRAINING_ARGS, "--checkpoint_dir", str(tmp_path / "ck"),
            "--audit_log", str(tmp_path / "audit"), "--collective_timeout_s", "5", "--watchdog_timeout_s", "0"]


def events(tmp_path, kind: str) -> list[dict]:
    path = tmp_path / "ck" / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [event for event in map(json.loads, lines) if event["event"] == kind]


def test_a_worker_that_loses_a_peer_twice_ends_in_the_restart_path_with_its_step_kept(tmp_path, stand_in_nodes):
    """The worker's side alone, the agents played by the test: a peer lost as a step's forward
    begins (a model with BatchNorm: the survivors' first collective of the step is the broadcast of
    its buffers, in_process.InterruptibleDDP; they abandon the step there), a round in process (the
    survivors re-form on a new port and keep their own state), a round that loses no node announced
    to one node before the other (agents take a round at their own polls: both workers still leave
    after the same step), then a second loss, whose round the agent answers with a restart: the
    worker ends (torchrun would restart it), its last committed step kept in its node's memory, and
    nothing hangs."""
    hold = tmp_path / "hold"
    env = hold_settings(hold)["env"]
    # Rank 2 dies as step 3's forward begins (past the group's second step, whose forward rebuilds
    # DDP's buckets in one blocking call of DDP's).
    env[FAULT_VARIABLE] = f"rank=2,step=3,at=forward,once={tmp_path / 'fired'}"
    args = stand_in_args(tmp_path)
    args[args.index("--watchdog_timeout_s") + 1] = "3"  # its mark tells a peer that a rank switched
    nodes = stand_in_nodes(3, [*args, "--model", "mini_resnet"], env)
    nodes[2].agent.wait(timeout=120)
    assert (tmp_path / "fired").exists(), nodes[2].log_text()
    first = events(tmp_path, "start")[0]
    survivors = nodes[:2]

    def running() -> str | None:
        return None if all(node.agent.poll() is None for node in survivors) else "a worker ended"

    # As the agents do: the round runs once one worker asks. A survivor whose broadcast waits on the
    # one that asked (gloo tells only the dead rank's neighbours) is freed by the announcement.
    wait_for(lambda: any(node.requests() for node in survivors), 60, "a survivor's request", still_possible=running)
    port = free_port()
    for rank, node in enumerate(survivors):
        node.announce(round_handoff.RoundAnnouncement(1, rank, 2, "127.0.0.1", port, True, first_rank=rank,
                                                      world_size=2))
    wait_for(lambda: len(events(tmp_path, "start")) == 2, 60, "the survivors' group", still_possible=running)
    logs = [node.log_text() for node in survivors]
    assert any("step 3's forward (DDP's own collectives)" in log for log in logs), logs
    assert not any("Timed out waiting" in log for log in logs), ("the announcement, not gloo's timeout", logs)
    start = events(tmp_path, "start")[1]
    assert start["in_process"] is True and start["world_size"] == 2, start
    assert {rank["pid"] for rank in start["ranks"]} == {rank["pid"] for rank in first["ranks"][:2]}, (first, start)
    restore = next(event for event in events(tmp_path, "restore") if event["incarnation"] == start["incarnation"])
    assert restore["lost_steps"] == 0 and restore["source"] == "live", restore
    wait_for(lambda: sum(e["incarnation"] == start["incarnation"] for e in events(tmp_path, "step")) >= 3, 60,
             "three steps of the survivors' group", still_possible=running)

    # Node 0's agent announces round 2 first: its worker leaves after its step N. Node 1's worker,
    # told nothing by its agent, may begin step N + 1 and wait in its all-reduce: node 0's watchdog
    # mark (`switched after N`) makes it leave after N too, and ask its agent for the round.
    port = free_port()
    survivors[0].announce(round_handoff.RoundAnnouncement(2, 0, 2, "127.0.0.1", port, True, first_rank=0,
                                                          world_size=2))
    wait_for(lambda: survivors[1].requests(), 30, "the other worker's request", still_possible=running)
    survivors[1].announce(round_handoff.RoundAnnouncement(2, 1, 2, "127.0.0.1", port, True, first_rank=1,
                                                          world_size=2))
    wait_for(lambda: len(events(tmp_path, "start")) == 3, 60, "the group re-formed after one step on both",
             still_possible=running)
    switched = events(tmp_path, "start")[2]
    assert switched["in_process"] is True and {rank["pid"] for rank in switched["ranks"]} == \
        {rank["pid"] for rank in start["ranks"]}, (start, switched)
    both = next(event for event in events(tmp_path, "restore") if event["incarnation"] == switched["incarnation"])
    assert both["lost_steps"] == 0 and both["source"] == "live", both  # live: both held the same step
    assert "sent no heartbeat" not in survivors[1].log_text(), "the mark, not the watchdog's bound"
    wait_for(lambda: any(e["incarnation"] == switched["incarnation"] for e in events(tmp_path, "step")), 60,
             "a step of the re-formed group", still_possible=running)

    signal_tree(survivors[1].agent.pid, signal.SIGKILL)  # a second node lost: this time the agent restarts
    wait_for(lambda: survivors[0].requests(), 60, "the last worker's request")
    survivors[0].announce(round_handoff.RoundAnnouncement(3, 0, 1, "127.0.0.1", free_port(), False,
                                                          "a member arrived without the in-process mark"))
    assert survivors[0].agent.wait(timeout=60) == 1, survivors[0].log_text()
    log = survivors[0].log_text()
    assert "the agent restarts the workers instead: a member arrived without the in-process mark" in log, log
    # Kept on its way out (SIGTERM would wait for the keep), so the fallback loses nothing.
    kept = [event for event in events(tmp_path, "memory_copy") if event["incarnation"] == switched["incarnation"]]
    assert kept and kept[-1]["global_step"] >= both["global_step"], "the last step kept for torchrun's restart"
    assert "RejoinRefused" in kept[-1]["reason"], kept[-1]


def test_a_node_lost_while_the_survivors_re_form_ends_in_torchruns_restart_not_a_hang(local_jobs, tmp_path):
    """Two nodes lost one after the other, the second while the survivors form the group of the
    round their agents took in process: the last survivor's group never forms. It waits at most
    the collective timeout, keeps its step, and torchrun restarts it; the job ends with every promise."""
    epochs = 4  # (paced: the job outlasts the scenario)
    settings = hold_settings(tmp_path / "hold")
    settings["module"] = FAULT_MODULE
    settings["env"][FAULT_VARIABLE] = f"rank=1,step=1,at=reform,once={tmp_path / 'fired'}"
    args = [*TRAINING_ARGS, "--epochs", str(epochs), "--collective_timeout_s", "5"]
    job = local_jobs(args, launcher=STOCK_LAUNCHER, rdzv_backend=BACKEND_NAME, rdzv_conf=None, monitor_interval=None,
                     **settings)
    nodes = [job.add_node(name) for name in ("a", "b", "c")]
    first = world_reached(job, 3)
    node_of = {rank["rank"]: next(node for node in nodes if node.pid == rank["agent_pid"]) for rank in first["ranks"]}
    wait_for(lambda: len([e for e in job.events("step") if e["incarnation"] == first["incarnation"]]) >= 3, 120,
             "a third step of the group of three (past the buckets' rebuild)",
             still_possible=lambda: None if all(node.is_running() for node in nodes) else "a node ended")
    killed_at = time.time()
    node_of[2].kill()  # the first loss; rank 1's node dies as the survivors form their group (the fault)
    wait_for(lambda: (tmp_path / "fired").exists(), 60, "the second loss, during the re-form")
    alone = job.wait_for_event(lambda e: e["event"] == "start" and e["world_size"] == 1 and e["time"] > killed_at, 90,
                               "the last survivor's group")
    assert alone["in_process"] is False, ("torchrun's restart, not another re-form", alone)
    restore = job.wait_for_event(lambda e: e["event"] == "restore" and e["incarnation"] == alone["incarnation"], 30,
                                 "its restore")
    assert restore["lost_steps"] == 0 and restore["source"] == "memory", restore
    release(tmp_path / "hold")
    assert node_of[0].wait(timeout=120) == 0, node_logs(job)
    assert "the in-process re-form did not end" not in node_of[0].log_text(), "bounded by the group's timeout"
    assert_exactly_once(job, DATASET, epochs, BATCH)
