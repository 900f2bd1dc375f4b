"""A restarted node can always rejoin, also with the same identity (docs/failure-semantics.md).

A container restarted in place (`restartPolicy: OnFailure`) runs torchrun as PID 1 again, at the
same address: torch names the new agent exactly as the old one (address, pid, counter). Here every
agent is PID 1 of a PID namespace of its own (`unshare --pid --fork --kill-child`, root only) with
an address of its own (`--local_addr` 127.0.0.x), on real torchrun agents and
`--rdzv_backend=elastic-c10d`; the dead-node probes must not keep such a node out
(elastic_ddp.agent.rendezvous.liveness and probes; the rule alone: tests/unit/test_rendezvous_probes.py).
What it checks is read from the agents' logs and their rendezvous figures, not from the rendezvous's
state.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from elastic_ddp.handoff.rendezvous_figures import DIRECTORY_PREFIX, FILE_PREFIX
from elastic_ddp.testbed.local_cluster import STOCK_LAUNCHER
from tests.support.cluster import hold_settings, node_logs, release, world_reached

EVICTION_LOG = "has exited (its beacon refuses connections)"


def _why_no_pid_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "PID namespaces (unshare --pid) need root"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is missing"
    return None


def _own_tmpdir(tmp_path: Path, name: str) -> tuple[Path, list[str]]:
    """A TMPDIR of the node's own and the command prefix that gives it to its agent: every agent here
    is PID 1, so their rendezvous figures (elastic_ddp.agent.rendezvous_metrics) would share one file."""
    tmpdir = tmp_path / f"{name}-tmp"
    tmpdir.mkdir()
    return tmpdir, ["env", f"TMPDIR={tmpdir}"]


def _rounds_joined(tmpdir: Path) -> int:
    """The rendezvous rounds the agent (PID 1) with this TMPDIR completed, from its figures file. A
    survivor is in every round, so this counts every round that completed, also those whose workers
    were stopped before they wrote a `start` event (whose `round` counts only the groups that
    trained)."""
    figures = tmpdir / f"{DIRECTORY_PREFIX}{os.getuid()}" / f"{FILE_PREFIX}1.json"
    return int(json.loads(figures.read_text())["rounds"])


@pytest.mark.skipif(_why_no_pid_namespaces() is not None, reason=_why_no_pid_namespaces() or "")
@pytest.mark.timeout(300)
def test_a_container_restarted_with_the_same_node_identity_rejoins_without_being_removed(local_jobs, tmp_path):
    """Each agent is plain torchrun as PID 1 of a PID namespace of its own, with an address of its
    own, as in a container: a node killed and started again the same way has the same torch node
    identity (address, pid 1, counter 0). The survivors' probes found it exited; that verdict must
    not outlive it: nobody removes the restarted node, and it is in the round after the survivors'.
    Before the fix they removed it again at every look at the state while they waited, and it got
    in only when its own write completed a round first (1-2 rounds here, 9 once for the issue)."""
    hold = tmp_path / "hold"
    args = ["--model", "mlp", "--epochs", "1000", "--dataset_size", "1024", "--global_batch_size", "64",
            "--snapshot_every_steps", "50", "--log_interval", "10"]
    # Held (elastic_ddp/chaos/held_train.py): 16000 steps of at least 0.05 s cannot end before the
    # restarted node is back; max_restarts well above the rounds this can take, so that a regression
    # shows as a count of rounds, not as an agent out of restarts.
    job = local_jobs(args, nnodes="1:3", rdzv_backend="elastic-c10d", launcher=STOCK_LAUNCHER, max_restarts=100,
                     **hold_settings(hold))
    tmpdirs = {name: _own_tmpdir(tmp_path, name) for name in ["host", "peer", "lost"]}
    try:
        host, peer, lost = (job.add_node(name, local_addr=f"127.0.0.{index + 2}", pid_namespace=True,
                                         command_prefix=tmpdirs[name][1])
                            for index, name in enumerate(["host", "peer", "lost"]))
        world_reached(job, 3)
        killed_at = time.time()
        lost.kill()  # SIGKILL to the namespace's PID 1 (torchrun): the kernel ends its workers too
        without = job.wait_for_event(lambda e: e["event"] == "start" and e["time"] > killed_at, 60,
                                     "the survivors' group after the kill")
        assert without["world_size"] == 2, node_logs(job)
        survivors_rounds = _rounds_joined(tmpdirs["host"][0])
        evictions_before = host.log_text().count(EVICTION_LOG) + peer.log_text().count(EVICTION_LOG)
        restarted_at = time.time()
        lost.start()  # the same command: the same identity
        back = job.wait_for_event(
            lambda e: e["event"] == "start" and e["time"] > restarted_at and e["world_size"] == 3, 90,
            "a group of world size 3 with the restarted node")
        rounds = _rounds_joined(tmpdirs["host"][0]) - survivors_rounds
        evictions = host.log_text().count(EVICTION_LOG) + peer.log_text().count(EVICTION_LOG) - evictions_before
        measured = (f"the restarted node rejoined {rounds} rendezvous round(s) after the survivors' "
                    f"({back['round'] - without['round']} in the event log), removed {evictions} time(s) as "
                    f"exited meanwhile, {back['time'] - restarted_at:.1f} s after its restart")
        print(measured)
        # A probe never evicts a live agent: the restarted one answers, so nobody removes it.
        assert evictions == 0 and rounds <= 2, f"{measured}\n{node_logs(job)}"
    finally:
        release(hold)
