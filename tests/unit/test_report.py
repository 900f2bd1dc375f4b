"""`elastic-ddp report` on a hand-written event log: drains, restarts, relaunches, failed writes and
replication told apart; errors that name the path; help with examples; no matplotlib.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from elastic_ddp.runlog.timeline import HistoryError, load_history
from elastic_ddp.tools import cli

pytestmark = pytest.mark.timeout(300)

EPOCHS, DATASET, BATCH = 2, 4096, 64


def report_json(run_dir: Path, capsys, *extra: str) -> dict:
    assert cli.main(["report", str(run_dir), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_report_errors_name_the_path_and_what_was_expected(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello\n")
    for path, message in ((tmp_path / "missing", "no such file or directory"),
                          (tmp_path, "not an elastic_ddp run directory"),
                          (tmp_path / "notes.txt", "holds no elastic_ddp events")):
        assert cli.main(["report", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"elastic-ddp report: error: {path}") and message in err, err
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "events.jsonl").write_text("")
    with pytest.raises(HistoryError, match="several event logs"):
        load_history(tmp_path)


def test_a_report_without_matplotlib_prints_the_summary_and_exits_3(tmp_path, capsys, monkeypatch):
    log = tmp_path / "events.jsonl"
    log.write_text(json.dumps({"time": 1.0, "event": "start", "incarnation": 1, "world_size": 2}) + "\n"
                   + json.dumps({"time": 2.0, "event": "step", "incarnation": 1, "global_step": 1, "epoch": 0}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert cli.main(["report", str(tmp_path)]) == 3
    captured = capsys.readouterr()
    assert "Progress     step 1; 0 epochs completed" in captured.out
    assert "no plot: matplotlib is not installed: pip install 'elastic_ddp[report]'" in captured.err


@pytest.mark.parametrize("command", [[], ["report"], ["inspect"], ["chaos"]])
def test_every_command_has_help_with_an_example(command, capsys):
    if command == ["chaos"] and importlib.util.find_spec("elastic_ddp.chaos.cli") is None:
        pytest.skip("elastic_ddp.chaos.cli is not in this tree yet")
    with pytest.raises(SystemExit) as exited:
        cli.main([*command, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "  elastic-ddp " in out, out
    if not command:
        assert "exit status: 0 success; 1 nothing usable found" in out


def synthetic_log(path: Path) -> None:
    """Four incarnations: drained 4 -> 3, a crash and restart in world 3, a relaunch after finishing."""
    lines = []

    def emit(time: float, incarnation: int, event: str, **fields) -> None:
        lines.append(json.dumps({"time": time, "event": event, "incarnation": incarnation, **fields}))

    emit(0.0, 1, "start", world_size=4, nodes=2, run_id="synthetic")
    emit(0.1, 1, "replication", replicas=1, target_nodes=[1], target_ranks=[2])
    for step in range(1, 21):
        emit(step, 1, "step", global_step=step, epoch=0)
        if step % 5 == 0:
            emit(step + 0.1, 1, "progress", global_step=step, epoch=0, loss=1 / step, lr=0.1, samples_per_second=400.0,
                 world_size=4)
            emit(step + 0.2, 1, "snapshot", global_step=step, epoch=0, size_bytes=1000, write_seconds=0.5)
            if step < 20:
                emit(step + 0.3, 1, "snapshot_replicated", global_step=step, sha256="a" * 64, nodes=[1], seconds=0.1)
    emit(20.3, 1, "replication_failed", global_step=20, node=1, error="transfer failed: timed out")
    emit(20.5, 1, "drain", global_step=20, snapshot_durable=True)
    emit(30.0, 2, "start", world_size=3, nodes=2)
    emit(30.1, 2, "restore", global_step=20, epoch=0, lost_steps=0, lost_seconds=0.0, source="memory", source_rank=1,
         source_host="node-b")
    for step in range(21, 31):
        emit(10 + step, 2, "step", global_step=step, epoch=0)
    emit(35.5, 2, "snapshot", global_step=25, epoch=0, size_bytes=1000, write_seconds=0.25)
    emit(40.5, 2, "snapshot_failed", global_step=30, error="disk full")
    emit(50.0, 3, "start", world_size=3, nodes=2)
    emit(50.1, 3, "restore", global_step=25, epoch=0, lost_steps=5, lost_seconds=5.0, source="file", source_rank=0,
         source_host="node-a")
    emit(51.0, 3, "step", global_step=26, epoch=1)
    emit(51.5, 3, "epoch_end", epoch=0, global_step=26)
    emit(52.0, 3, "mystery", detail="from a newer version")
    emit(53.0, 3, "finished", global_step=26, seconds=3.0)
    emit(60.0, 4, "start", world_size=3, nodes=2)
    emit(60.1, 4, "restore", global_step=26, epoch=1, lost_steps=0, lost_seconds=0.0)
    emit(60.2, 4, "finished", global_step=26, seconds=0.2)
    path.write_text("\n".join(lines) + "\n{\"torn")


def test_drains_restarts_relaunches_and_failed_writes_are_told_apart(tmp_path, capsys):
    synthetic_log(tmp_path / "events.jsonl")
    summary = report_json(tmp_path, capsys, "--plot", str(tmp_path / "plot.png"))
    assert [t["kind"] for t in summary["transitions"]] == ["node drained", "restart", "relaunch after finish"]
    assert [t["resumed_from"] for t in summary["transitions"]] == [
        "memory of rank 1 on node-b", "a snapshot file", None]  # None: a restore event without `source` (older logs)
    assert (summary["failures"], summary["drains"], summary["joins"], summary["restores"]) == (1, 1, 0, 3)
    assert summary["lost_steps_total"] == 5
    # Without training: 20.5 -> 31 (drain), 40.5 -> 51 (crash); a relaunch after finishing is not downtime.
    assert summary["downtime_seconds_total"] == pytest.approx(10.5 + 10.5)
    assert summary["snapshots"]["failed"] == 1 and summary["snapshots"]["write_seconds_max"] == 0.5
    assert summary["other_events"] == {"mystery": 1}
    assert summary["replication"] == {"replicas_asked": 1, "target_nodes": [1], "replicated": 3,
                                      "last_replicated_step": 15, "failed": 1,
                                      "last_failure": "transfer failed: timed out"}
    assert summary["world_sizes"][0] == {"world_size": 4, "nodes": 2, "from_seconds": 0.0, "to_seconds": 20.5}
    assert summary["finished"] and summary["final_step"] == 26 and summary["epochs_completed"] == 1
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert cli.main(["report", str(tmp_path / "events.jsonl"), "--no-plot"]) == 0
    text = capsys.readouterr().out
    assert "Incidents    1 failure, 1 drain, 0 joins, 3 restores over 4 incarnations" in text
    assert ("node drained: world 4 -> 3, resumed from step 20 from memory of rank 1 on node-b, lost 0 steps (0.0 s), "
            "10.5 s without training") in text
    assert "restart: world 3 -> 3, resumed from step 25 from a snapshot file, lost 5 steps" in text
    assert "Work lost    5 steps redone (5.0 s of training);" in text
    assert "relaunch after finish: world 3 -> 3, resumed from step 26 (no work to redo)" in text
    assert "1 snapshot write FAILED" in text
    assert ("Replication  3 snapshots copied to other nodes (newest: step 15); 1 delivery FAILED (last: "
            "transfer failed: timed out; see the replication_failed events)") in text
    assert "Other events mystery x1" in text
    assert "Plot" not in text
