"""`python -m elastic_ddp.tools.quickstart RUN_DIR [training args]`: a failure survived, on this machine.

What `bash launch/quickstart.sh` runs after setting up .venv: an elastic job of three local nodes
(real torchrun agents on 127.0.0.1, gloo workers, a c10d rendezvous store in a process of its own),
then one node SIGKILLed mid-epoch, agent and workers, as a machine dies, and a node started again
once the survivors train without it. Then the run's report (`elastic-ddp report`): the world sizes,
the steps each restart lost, the seconds without training, the plot's path; and the chaos verdict
(every sample trained exactly once, the final step reached).

The job is held (elastic_ddp/chaos/held_train.py: each step sleeps while a hold file exists) until
the restarted node trains in the group, then released to its end at full speed: however fast the
machine, the kill lands mid-epoch and the node is back before the job ends.

The first worker group holds all three nodes, however loaded the machine: the job's largest size
is three nodes, at which torch's rendezvous completes a round at once, and its last call is long
(`FIRST_GROUP_WAIT_S`), so that a first round that reached one or two nodes waits for the agents
still starting (three warm-worker servers importing torch on two cores can hold one back for seconds)
instead of forming without them. Later rounds never wait for that last call: the round after the
kill completes as soon as both survivors are back (the dead node's agent is found exited: prompt
completion, docs/operations.md), and the one with the restarted node reaches three nodes.

    python -m elastic_ddp.tools.quickstart runs/quickstart --epochs 3

Exit status 0 when the run finished and every promise the verdict checks held, 1 otherwise, 2 for
arguments it cannot use. The plain two-node run without a failure is `launch/local_cluster.sh`
(`bash launch/quickstart.sh --plain`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from elastic_ddp.agent.rendezvous.defaults import SHIPPED_RDZV_DEFAULTS
from elastic_ddp.chaos.harness import ChaosHarness, expected_final_step
from elastic_ddp.chaos.held_train import HOLD_VARIABLE
from elastic_ddp.chaos.plan import Fault, FaultPlan
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.testbed.local_cluster import wait_for
from elastic_ddp.tools import cli

HELD_MODULE = "elastic_ddp.chaos.held_train"
NODES = 3
KILLED = "node1"  # not the first node: the report then shows rank 0 keep its place
BACK_STEPS = 3  # steps the group with the restarted node trains, held, before the job is released
DEADLINE_S = 600
MIN_STEPS = 12  # a kill and a rejoin mid-run need room
# The last call, which only the first round waits for (see the module docstring); an agent that
# has not joined by then (one that failed to start) leaves the first group without it, as before.
FIRST_GROUP_WAIT_S = 20
RDZV_CONF = ",".join(f"{key}={value}" for key, value in
                     {**SHIPPED_RDZV_DEFAULTS, "last_call_timeout": FIRST_GROUP_WAIT_S}.items())


def fault_steps(total_steps: int) -> tuple[int, int]:
    """(the step at which the node is killed, the step of the smaller group at which it comes back)."""
    kill = max(2, total_steps // 6)
    return kill, kill + max(2, total_steps // 12)


def the_plan(total_steps: int) -> FaultPlan:
    kill, back = fault_steps(total_steps)
    return FaultPlan(initial_nodes=NODES, min_nodes=1, max_nodes=NODES, faults=(
        Fault("kill_node", target=KILLED, at_step=kill),
        Fault("add_node", at_step=back),  # counted in the group that formed without the killed node
    ))


def release_once_back(event_log: Path, hold: Path, world_size: int, deadline_s: float) -> None:
    """Wait until a worker group of `world_size` that started after the kill has trained
    BACK_STEPS steps, then delete the hold file (the job runs to its end at full speed)."""
    def back() -> bool:
        events = read_events(event_log)
        starts = [e for e in events if e["event"] == "start"]
        if len(starts) < 2 or starts[-1]["world_size"] != world_size:
            return False
        steps = [e for e in events if e["event"] == "step" and e["incarnation"] == starts[-1]["incarnation"]]
        return len(steps) >= BACK_STEPS

    try:
        wait_for(back, deadline_s, f"a group of {world_size} ranks with the restarted node")
    finally:
        hold.unlink(missing_ok=True)


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m elastic_ddp.tools.quickstart",
                                     description="Three local nodes, one killed mid-epoch and started again, "
                                                 "then the run's report. Other arguments go to the trainer.")
    parser.add_argument("run_dir", type=Path, help="where the nodes' logs, snapshots (ck/) and events go")
    return parser.parse_known_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args, training_args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s quickstart: %(message)s", datefmt="%H:%M:%S")
    try:
        _, total_steps = expected_final_step(training_args)
    except ValueError as exc:
        print(f"quickstart: {exc}", file=sys.stderr)
        return 2
    if total_steps < MIN_STEPS:
        print(f"quickstart: the run has {total_steps} steps; expected at least {MIN_STEPS} (more --epochs or a "
              "larger --dataset_size), so that a node can be killed and come back mid-run", file=sys.stderr)
        return 2
    run_dir = args.run_dir.absolute()  # the nodes run in directories of their own
    run_dir.mkdir(parents=True, exist_ok=True)
    hold = run_dir / "hold"
    hold.touch()
    kill, back = fault_steps(total_steps)
    print(f"quickstart: {NODES} nodes train {total_steps} steps; {KILLED} is SIGKILLed at step {kill} and a node "
          f"is started again at step {back}; logs in {args.run_dir}", file=sys.stderr, flush=True)
    harness = ChaosHarness(run_dir, training_args, the_plan(total_steps), module=HELD_MODULE, rdzv_conf=RDZV_CONF,
                           env={HOLD_VARIABLE: str(hold)}, deadline_s=DEADLINE_S, run_id="quickstart",
                           on_plan_done=lambda: release_once_back(harness.job.event_log, hold, NODES, DEADLINE_S))
    verdict = harness.run()
    hold.unlink(missing_ok=True)
    print(flush=True)
    reported = cli.main(["report", str(harness.job.checkpoint_dir)])
    print(f"\n{verdict.summary()}", flush=True)
    return 0 if verdict.ok and reported == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
