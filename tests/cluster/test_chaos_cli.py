"""`python -m elastic_ddp.chaos` explains itself and refuses a bad plan with its reason; its
standalone store listens where it says; as root, `elastic-ddp chaos` plays network faults.

    .venv/bin/python -m pytest tests/cluster/test_chaos_cli.py -q -s
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runlog.schema import EVENT_LOG_NAME
from elastic_ddp.testbed.local_cluster import free_port, port_is_listening, wait_for
from elastic_ddp.testbed.netns import why_unavailable
from tests.support.cluster import hold_settings, pause_at, release

NO_NAMESPACES = why_unavailable()
BLIP_S = 1.0  # below the peer watchdog's default bound (--watchdog_timeout_s 3)


def test_the_chaos_cli_explains_itself_and_refuses_bad_input(tmp_path):
    help_text = subprocess.run([sys.executable, "-m", "elastic_ddp.chaos", "--help"], capture_output=True,
                               text=True, check=True).stdout
    assert "--random" in help_text and "--plan" in help_text and "--compare" in help_text
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"faults": [{"action": "explode"}]}))
    result = subprocess.run([sys.executable, "-m", "elastic_ddp.chaos", "--plan", str(bad), "--run-dir",
                             str(tmp_path / "run"), "--", "--model", "mlp"], check=False, capture_output=True,
                            text=True)
    assert result.returncode == 2 and "fault action: got 'explode'" in result.stderr


def listening_addresses(port: int) -> set[str]:
    """The local addresses with a socket listening on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            for line in list(handle)[1:]:
                local, _, state = line.split()[1:4]
                address, port_hex = local.rsplit(":", 1)
                if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


@pytest.mark.timeout(60)
def test_the_standalone_store_listens_on_the_address_it_names_only():
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "elastic_ddp.chaos.store", f"127.0.0.1:{port}"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: port_is_listening("127.0.0.1", port) or store.poll() is not None, 30, "the store")
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, and not 0.0.0.0 or ::
    finally:
        store.send_signal(signal.SIGTERM)
        output = store.communicate(timeout=30)[0]
    assert f"c10d store listening on 127.0.0.1:{port} (that address only)" in output


@pytest.mark.skipif(NO_NAMESPACES is not None, reason=f"no network namespaces: {NO_NAMESPACES}")
@pytest.mark.timeout(240)
def test_the_chaos_cli_plays_a_blip_a_partition_and_a_heal_on_hosts_of_their_own(tmp_path):
    """`elastic-ddp chaos --plan` as root, with a plan of network faults: each node and the
    standalone store a host of its own (elastic_ddp/chaos/network.py). node1 loses its link for
    1 s (below the peer watchdog's bound): gloo's TCP retransmits carry the collectives over the
    gap, no group re-forms, nothing is lost. Then node1 is partitioned: node0 trains on alone;
    healed, node1 rejoins by itself. Every promise held (exit 0: exactly once, every fault fired,
    at most one step lost each). The job is held, and paused after step 70, until node1 is back
    (elastic_ddp/chaos/held_train.py)."""
    hold = tmp_path / "hold"
    held = hold_settings(hold)
    pause_at(hold, 70)  # after the heal (at step 60 of node0's group alone)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"initial_nodes": 2, "min_nodes": 1, "max_nodes": 2, "faults": [
        {"action": "blip_node", "target": "node1", "seconds": BLIP_S, "at_step": 20},
        # A blip re-forms no group: counting steps of a group that started after it would wait forever.
        {"action": "partition_node", "target": "node1", "at_step": 40, "settle": False},
        {"action": "heal_node", "target": "node1", "at_step": 60}]}))
    run_dir, report = tmp_path / "run", tmp_path / "report.json"
    # 160 steps held at 0.05 s or more each, paused after step 70: the job cannot end before node1 is back.
    args = ["--model", "mlp", "--epochs", "10", "--dataset_size", "1024", "--global_batch_size", "64",
            "--snapshot_every_steps", "20", "--log_interval", "10"]
    command = [str(Path(sys.executable).with_name("elastic-ddp")), "chaos", "--plan", str(plan), "--run-dir",
               str(run_dir), "--module", held["module"], "--deadline", "200", "--report", str(report), "--", *args]
    chaos = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, **held["env"]})
    events = run_dir / "ck" / EVENT_LOG_NAME

    def world_sizes() -> str:
        """The worker groups' world sizes so far, a size repeated in a row once: "2 1 2" once node1 is back."""
        sizes = [e["world_size"] for e in read_events(events) if e["event"] == "start"] if events.exists() else []
        return " ".join(str(size) for size, _ in itertools.groupby(sizes))

    try:
        wait_for(lambda: "2 1 2" in world_sizes(), 180, "node1 in the group again after the heal",
                 still_possible=lambda: None if chaos.poll() is None else f"the chaos run exited {chaos.returncode}")
    finally:
        release(hold)
        output = chaos.communicate(timeout=120)[0]
    assert chaos.returncode == 0, output[-6000:]
    blip, partition, heal = json.loads(report.read_text())["faults"]
    assert all(fault["fired"] for fault in (blip, partition, heal)), output[-3000:]
    logged = read_events(events)
    starts = [e["time"] for e in logged if e["event"] == "start"]
    assert not [when for when in starts if blip["fired_at"] < when < partition["fired_at"]], \
        f"the group re-formed after the blip\n{output[-3000:]}"
    # Through the first step once the link is back, whenever that came: a window that ended 1 s after
    # the blip measured no stall at all when training resumed later than that (CI at 4c13a80: 0.06 s).
    times = sorted(e["time"] for e in logged if e["event"] == "step")
    resumed = next(t for t in times if t >= blip["fired_at"] + BLIP_S)
    steps = [t for t in times if blip["fired_at"] - 1 < t <= resumed]
    stall = max(later - earlier for earlier, later in itertools.pairwise(steps))
    print(f"chaos CLI: a {BLIP_S:g} s blip of node1 stopped training {stall:.2f} s (no group re-formed); the partition: "
          f"node0 trained again {partition['recovery_seconds']} s later; node1 back after the heal")
    assert stall > BLIP_S / 2, (f"the blip did not stop training ({stall:.2f} s between steps): did it bite? steps "
                                f"from 1 s before it, s after it fired: {[round(t - blip['fired_at'], 2) for t in steps]}")
