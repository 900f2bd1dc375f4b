"""`elastic-ddp report` on a hand-written event log: drains, restarts, relaunches, failed writes and
replication told apart; held-out evaluations summarised and plotted; errors that name the path; help
with examples; no matplotlib.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from elastic_ddp.runlog.run_history import HistoryError, load_history
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
    with pytest.raises(SystemExit) as exited:
        cli.main([*command, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "  elastic-ddp " in out, out
    if not command:
        assert "exit status: 0 success; 1 nothing usable found" in out


# The held-out evaluations `synthetic_log` writes, as (time, incarnation, step, loss, accuracy): the
# one of step 30 is rolled back by the restart from step 25, and is the best by loss and accuracy.
EVALUATIONS = ((10.4, 1, 10, 0.5, 0.6), (20.4, 1, 20, 0.3, 0.8), (40.4, 2, 30, 0.2, 0.85), (51.2, 3, 26, 0.25, 0.82))


def synthetic_log(path: Path, evaluations: bool = False, accuracy: bool = True) -> None:
    """Four incarnations: drained 4 -> 3, a crash and restart in world 3, a relaunch after finishing;
    with `evaluations`, the eval events of EVALUATIONS (accuracy null unless `accuracy`)."""
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
         source_host="node-a", refused=[{"source": "memory", "global_step": 30, "host": "node-b",
                                         "reason": "non-finite: model.w"}])
    emit(51.0, 3, "step", global_step=26, epoch=1)
    emit(51.5, 3, "epoch_end", epoch=0, global_step=26)
    emit(52.0, 3, "mystery", detail="from a newer version")
    emit(53.0, 3, "finished", global_step=26, seconds=3.0)
    emit(60.0, 4, "start", world_size=3, nodes=2)
    emit(60.1, 4, "restore", global_step=26, epoch=1, lost_steps=0, lost_seconds=0.0)
    emit(60.2, 4, "finished", global_step=26, seconds=0.2)
    if evaluations:
        for time, incarnation, step, loss, score in EVALUATIONS:
            emit(time, incarnation, "eval", global_step=step, epoch=int(step == 26), loss=loss,
                 accuracy=score if accuracy else None, samples=512)
        lines.sort(key=lambda line: json.loads(line)["time"])  # in time order, as rank 0 appends them
    path.write_text("\n".join(lines) + "\n{\"torn")


def test_drains_restarts_relaunches_and_failed_writes_are_told_apart(tmp_path, capsys):
    synthetic_log(tmp_path / "events.jsonl")
    summary = report_json(tmp_path, capsys, "--plot", str(tmp_path / "plot.png"))
    assert [t["kind"] for t in summary["transitions"]] == ["node drained", "restart", "relaunch after finish"]
    assert [t["resumed_from"] for t in summary["transitions"]] == [
        "memory of rank 1 on node-b", "a snapshot file", None]  # None: a restore event without `source` (older logs)
    assert [[r["global_step"] for r in t["refused"]] for t in summary["transitions"]] == [[], [30], []]
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
    assert ("restart: world 3 -> 3, resumed from step 25 from a snapshot file (refused newer: memory of step 30, "
            "non-finite: model.w), lost 5 steps") in text
    assert "Work lost    5 steps redone (5.0 s of training);" in text
    assert "relaunch after finish: world 3 -> 3, resumed from step 26 (no work to redo)" in text
    assert "1 snapshot write FAILED" in text
    assert ("Replication  3 snapshots copied to other nodes (newest: step 15); 1 delivery FAILED (last: "
            "transfer failed: timed out; see the replication_failed events)") in text
    assert "Other events mystery x1" in text
    assert "Plot" not in text
    assert "Evaluation" not in text and summary["evaluation"]["count"] == 0


def test_held_out_evaluations_are_counted_with_the_last_by_time_and_the_best(tmp_path, capsys):
    synthetic_log(tmp_path / "events.jsonl", evaluations=True)
    summary = report_json(tmp_path, capsys, "--no-plot")
    # The step-30 evaluation was rolled back, yet it was run: counted, and the best; the last is by time.
    assert summary["evaluation"] == {"count": 4, "last_step": 26, "last_loss": 0.25, "last_accuracy": 0.82,
                                     "best_accuracy": 0.85, "best_accuracy_step": 30,
                                     "best_loss": 0.2, "best_loss_step": 30}
    assert cli.main(["report", str(tmp_path), "--no-plot"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Evaluation")]
    assert lines == [("Evaluation   4 held-out evaluations; last at step 26: loss 0.25, accuracy 82.0%; "
                      "best accuracy 85.0% at step 30")]


def test_held_out_evaluations_without_accuracy_are_ranked_by_loss(tmp_path, capsys):
    synthetic_log(tmp_path / "events.jsonl", evaluations=True, accuracy=False)
    summary = report_json(tmp_path, capsys, "--no-plot")
    assert summary["evaluation"]["last_accuracy"] is None and summary["evaluation"]["best_accuracy"] is None
    assert cli.main(["report", str(tmp_path), "--no-plot"]) == 0
    assert ("Evaluation   4 held-out evaluations; last at step 26: loss 0.25; lowest loss 0.2 at step 30"
            in capsys.readouterr().out)


def pixels_of(image, color: str) -> int:
    """How many pixels of `image` (RGB floats) are `color` (#rrggbb), give or take antialiasing."""
    rgb = tuple(int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return int((abs(image[:, :, :3] - rgb) < 0.02).all(axis=2).sum())


@pytest.mark.parametrize("accuracy", [True, False], ids=["with accuracy", "loss only"])
def test_the_plot_draws_the_held_out_loss_and_any_accuracy(tmp_path, accuracy):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from elastic_ddp.tools.plot import EVAL_ACCURACY_STYLE, EVAL_LOSS_STYLE, PLOT_SIZE_PX, render_plot

    synthetic_log(tmp_path / "events.jsonl", evaluations=True, accuracy=accuracy)
    png = render_plot(load_history(tmp_path), tmp_path / "plot.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", data[16:24]) == PLOT_SIZE_PX
    image = imread(png)
    assert pixels_of(image, EVAL_LOSS_STYLE["color"]) > 100, "no held-out loss in the plot"
    accuracy_pixels = pixels_of(image, EVAL_ACCURACY_STYLE["color"])
    assert accuracy_pixels > 100 if accuracy else accuracy_pixels == 0, accuracy_pixels


def test_a_group_re_formed_in_process_is_told_apart_from_a_restart(tmp_path, capsys):
    """A `start` event with `in_process: true` (issue 44) is a node lost without a worker restart."""
    events = [{"time": 0.0, "event": "start", "incarnation": 1, "world_size": 6, "nodes": 3},
              {"time": 1.0, "event": "step", "incarnation": 1, "global_step": 10, "epoch": 0},
              {"time": 1.3, "event": "start", "incarnation": 2, "world_size": 4, "nodes": 2, "in_process": True},
              {"time": 1.3, "event": "restore", "incarnation": 2, "global_step": 10, "epoch": 0,
               "source": "memory", "source_rank": 0, "source_host": "a", "lost_steps": 0, "lost_seconds": 0.0},
              {"time": 1.4, "event": "step", "incarnation": 2, "global_step": 11, "epoch": 0}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(event) + "\n" for event in events))
    transition, = report_json(tmp_path, capsys)["transitions"]
    assert transition["kind"] == "node lost" and transition["in_process"] is True, transition
    assert cli.main(["report", str(tmp_path), "--no-plot"]) in (0, 3)
    assert "in process (no worker restarted)" in capsys.readouterr().out
