"""`elastic-ddp report` on a real recorded run, made the way docs/getting-started.md makes one:
`launch/local_cluster.sh` with two torchrun nodes, then node 1 SIGKILLed with the documented command.

The summary's numbers are checked against the event log read independently here; the plot against
the PNG format (signature, size) and its pixels (the failure is marked in the failure colour).
The same run shows the nodes' progress as plain log lines (their output goes to files) and the
restore as one readable line.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastic_ddp.testbed.local_cluster import free_port, signal_tree, wait_for
from elastic_ddp.runlog.reader import read_events
from elastic_ddp.runlog.progress import source_text
from elastic_ddp.tools import cli

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
EPOCHS, DATASET, BATCH = 2, 4096, 64
STEPS = EPOCHS * DATASET // BATCH
# --min_step_time_s: 128 steps take at least 13 s, so that the second node joins and is killed mid-run
# however fast the machine trains (the documented way to simulate a slower model).
TRAINING_ARGS = ["--model", "mlp", "--epochs", str(EPOCHS), "--dataset_size", str(DATASET), "--global_batch_size",
                 str(BATCH), "--micro_batch_size", "32", "--snapshot_every_steps", "5", "--log_interval", "2",
                 "--min_step_time_s", "0.1"]
# docs/getting-started.md, step 3: a node lost as a machine dies (workers first, then the agent).
KILL_NODE = 'agent=$(cat "$1"); kill -KILL $(pgrep -P "$agent") "$agent"'


@dataclass
class RecordedRun:
    run_dir: Path
    returncode: int
    stderr: str

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "ck"

    @property
    def event_log(self) -> Path:
        return self.checkpoint_dir / "events.jsonl"

    def node_logs(self) -> str:
        return "\n".join(path.read_text(errors="replace") for path in sorted((self.run_dir / "logs").glob("node*.log")))


def wait_for_event(event_log: Path, predicate, timeout: float, what: str,
                   script: subprocess.Popen | None = None) -> dict:
    found: list[dict] = []

    def seen() -> bool:
        found[:] = [e for e in read_events(event_log) if predicate(e)]
        return bool(found)

    def ended() -> str | None:
        return None if script is None or script.poll() is None else f"the run ended ({script.returncode})"

    wait_for(seen, timeout, what, still_possible=ended)
    return found[-1]


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory) -> RecordedRun:
    """A finished run with one node lost: world 2 (perhaps after a join), then world 1."""
    run_dir = tmp_path_factory.mktemp("recorded")
    logs, event_log = run_dir / "logs", run_dir / "ck" / "events.jsonl"
    env = {**os.environ, "PYTHON": sys.executable, "NODES": "2", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
           "RDZV_ID": "recorded", "RUN_LOGS": str(logs)}
    script = subprocess.Popen(["bash", str(REPO / "launch" / "local_cluster.sh"), *TRAINING_ARGS, "--checkpoint_dir",
                               str(run_dir / "ck")], env=env, cwd=run_dir, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        start = wait_for_event(event_log, lambda e: e["event"] == "start" and e["world_size"] == 2, 150,
                               "world size 2", script)
        # Kill once this group has a snapshot, so that there is a restore to report.
        wait_for_event(event_log, lambda e: e["event"] == "snapshot" and e["incarnation"] == start["incarnation"],
                       60, "a snapshot in world size 2", script)
        subprocess.run(["bash", "-c", KILL_NODE, "kill-node", str(logs / "node1.pid")], check=True, timeout=30)
        _, stderr = script.communicate(timeout=200)
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
        for pid_file in logs.glob("node*.pid"):  # workers run in sessions of their own
            signal_tree(int(pid_file.read_text()), signal.SIGKILL)
    return RecordedRun(run_dir, script.returncode, stderr)


def report_json(run_dir: Path, capsys, *extra: str) -> dict:
    assert cli.main(["report", str(run_dir), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_the_summary_numbers_match_the_event_log(recorded_run, capsys):
    assert "local_cluster: 2 nodes on 127.0.0.1:" in recorded_run.stderr
    summary = report_json(recorded_run.checkpoint_dir, capsys, "--no-plot")
    events = read_events(recorded_run.event_log)
    of = lambda kind: [e for e in events if e["event"] == kind]  # noqa: E731

    incarnations = list(dict.fromkeys(e["incarnation"] for e in events))
    assert summary["incarnations"] == len(incarnations) >= 2
    assert summary["finished"] and summary["final_step"] == of("step")[-1]["global_step"] == STEPS
    assert summary["epochs_completed"] == EPOCHS
    assert summary["duration_seconds"] == pytest.approx(events[-1]["time"] - events[0]["time"], abs=1e-3)
    assert [w["world_size"] for w in summary["world_sizes"]] == [
        next(e["world_size"] for e in of("start") if e["incarnation"] == i) for i in incarnations]

    restores = of("restore")
    # Every incarnation after some step was committed restores; one that follows a group that ended
    # before its first step (the nodes started in two rounds, a second apart) has nothing to restore.
    starts = {e["incarnation"]: e["time"] for e in of("start")}
    after_a_step = [i for i in incarnations[1:] if any(s["time"] < starts[i] for s in of("step"))]
    assert summary["restores"] == len(restores) == len(after_a_step) >= 1
    assert summary["lost_steps_total"] == sum(r["lost_steps"] for r in restores)
    lost = [t for t in summary["transitions"] if t["kind"] == "node lost"]
    assert len(lost) == 1 and (lost[0]["from_world_size"], lost[0]["to_world_size"]) == (2, 1)
    assert summary["failures"] == 1
    kill_restore = restores[-1]
    assert lost[0]["resumed_from_step"] == kill_restore["global_step"]
    assert lost[0]["lost_steps"] == kill_restore["lost_steps"]
    assert lost[0]["downtime_seconds"] > 0

    snapshots = of("snapshot")
    assert summary["snapshots"]["count"] == len(snapshots)
    assert summary["snapshots"]["size_bytes_max"] == max(s["size_bytes"] for s in snapshots)
    assert summary["snapshots"]["write_seconds_max"] == pytest.approx(max(s["write_seconds"] for s in snapshots))
    rates = [p["samples_per_second"] for p in of("progress")]
    # The report rounds to 0.1: the median of an even count can sit exactly halfway (x.x5), and the
    # float difference then exceeds 0.05 by a hair.
    assert summary["throughput"]["samples_per_second_median"] == round(statistics.median(rates), 1)
    assert summary["loss"]["last"] == of("progress")[-1]["loss"]


@pytest.mark.slow
def test_the_report_command_prints_the_story_and_draws_a_real_png(recorded_run):
    from elastic_ddp.tools.plot import KIND_COLORS, PLOT_SIZE_PX

    console_script = Path(sys.executable).with_name("elastic-ddp")
    # The run directory above CHECKPOINT_DIR: the report finds ck/events.jsonl itself.
    result = subprocess.run([str(console_script), "report", str(recorded_run.run_dir)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    snapshots = [e for e in read_events(recorded_run.event_log) if e["event"] == "snapshot"]
    assert f"step {STEPS}; {EPOCHS} epochs completed" in text
    assert "node lost: world 2 -> 1, resumed from step" in text
    assert f"Snapshots    {len(snapshots)} written" in text
    png = recorded_run.checkpoint_dir / "report.png"
    assert f"Plot         {png}" in text

    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == PLOT_SIZE_PX
    image = pytest.importorskip("matplotlib.image").imread(png)
    assert image.shape[:2] == (PLOT_SIZE_PX[1], PLOT_SIZE_PX[0])
    red = tuple(int(KIND_COLORS["node lost"][i:i + 2], 16) / 255 for i in (1, 3, 5))
    failure_pixels = ((abs(image[:, :, :3] - red) < 0.02).all(axis=2)).sum()
    assert failure_pixels > 200, "the lost node is not marked in the plot"


@pytest.mark.slow
def test_nodes_log_plain_progress_lines_and_the_restore_in_one_line(recorded_run):
    logs = recorded_run.node_logs()
    assert "\r" not in logs  # files get log lines, never a bar
    assert f"epoch 1/{EPOCHS}, step 2/{DATASET // BATCH} of the epoch: loss" in logs
    restore = next(e for e in reversed(read_events(recorded_run.event_log)) if e["event"] == "restore")
    source = source_text(restore["source"], restore["source_rank"], restore["source_host"])
    assert (f"node lost: world 2 -> 1, resumed from step {restore['global_step']} (epoch {restore['epoch'] + 1}/"
            f"{EPOCHS}) from {source}, lost {restore['lost_steps']} step") in logs


@pytest.mark.slow
def test_inspect_on_the_recorded_run_finds_the_final_snapshot(recorded_run, capsys):
    assert cli.main(["inspect", str(recorded_run.checkpoint_dir)]) == 0
    out = capsys.readouterr().out
    assert f"newest valid: step {STEPS}" in out
    assert "BAD" not in out


