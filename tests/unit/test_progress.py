"""Progress on rank 0: plain log lines off a terminal, a bar on one, one line per restore; TensorBoard
when it is missing.
"""

from __future__ import annotations

import io
import logging
import sys

import pytest

from elastic_ddp.runlog import schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runlog.reader import PreviousIncarnation, previous_incarnation
from elastic_ddp.runlog.progress import ProgressReporter, restore_message, source_text
from elastic_ddp.runlog.tensorboard import open_scalars


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# ------------------------------------------------------------------------------------ the one line

def test_a_lost_node_is_announced_in_one_readable_line():
    previous = PreviousIncarnation(world_size=4, last_event_time=100.0, finished=False)
    line = restore_message(previous, snapshot_world_size=4, world_size=3, restored_step=1200, restored_epoch=1,
                           epochs=10, lost_steps=37, lost_seconds=9.8, now=114.2)
    assert line == ("node lost: world 4 -> 3, resumed from step 1200 (epoch 2/10), lost 37 steps (9.8 s), "
                    "14.2 s without training")


@pytest.mark.parametrize("before, after, finished, kind", [
    (2, 4, False, "node joined"), (3, 3, False, "restarted"), (2, 2, True, "relaunched")])
def test_the_line_names_what_happened(before, after, finished, kind):
    previous = PreviousIncarnation(world_size=before, last_event_time=0.0, finished=finished)
    line = restore_message(previous, before, after, 50, 0, 3, lost_steps=1, lost_seconds=0.5, now=2.0)
    assert line.startswith(f"{kind}: world {before} -> {after}, resumed from step 50 (epoch 1/3)")
    assert ("lost 1 step (0.5 s), 2.0 s without training" in line) == (kind != "relaunched")


def test_the_line_says_where_the_state_came_from():
    previous = PreviousIncarnation(world_size=4, last_event_time=100.0, finished=False)
    line = restore_message(previous, 4, 3, 1237, 1, 10, lost_steps=0, lost_seconds=0.0, now=101.5,
                           source=source_text("memory", 2, "node-b"))
    assert line == ("node lost: world 4 -> 3, resumed from step 1237 (epoch 2/10) from memory of rank 2 on node-b, "
                    "lost 0 steps (0.0 s), 1.5 s without training")
    assert source_text("file", 0, "node-a") == "a snapshot file"


def test_without_an_event_log_the_snapshot_tells_the_previous_world():
    line = restore_message(None, snapshot_world_size=8, world_size=6, restored_step=10, restored_epoch=0, epochs=1,
                           lost_steps=None, lost_seconds=None, now=0.0)
    assert line == "node lost: world 8 -> 6, resumed from step 10 (epoch 1/1)"


def test_the_previous_incarnation_is_read_from_the_event_log(tmp_path):
    path = tmp_path / "events.jsonl"
    old = EventLog(path, incarnation=1, enabled=True)
    old.emit(schema.START, round=1, world_size=4, local_world_size=1, nodes=4, ranks=[], restart_count=0, in_process=False,
             run_id="r")
    old.emit(schema.PROGRESS, global_step=10, epoch=0, world_size=4, loss=1.0, lr=0.1, samples_per_second=1.0)
    old.emit(schema.STEP, global_step=11, epoch=0)
    old.close()
    new = EventLog(path, incarnation=2, enabled=True)
    new.emit(schema.START, round=2, world_size=3, local_world_size=1, nodes=3, ranks=[], restart_count=1, in_process=False,
             run_id="r")
    new.close()
    previous = previous_incarnation(path, current=2)
    assert previous is not None and previous.world_size == 4 and not previous.finished
    assert previous_incarnation(tmp_path / "none.jsonl", current=2) is None


# ------------------------------------------------------------------------------------ the reporter

def test_off_a_terminal_progress_is_plain_log_lines(caplog):
    reporter = ProgressReporter("auto", epochs=2, steps_per_epoch=8, stream=io.StringIO())
    assert reporter.mode == "log"
    with caplog.at_level(logging.INFO, logger="elastic_ddp"):
        reporter.start_epoch(0, steps_done=2)
        for _ in range(4):
            reporter.advance()
        reporter.report(global_step=6, epoch=0, loss=0.25, lr=0.01, samples_per_second=1234.4, world_size=3)
        reporter.end_epoch()
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0] == "epoch 1/2, step 6/8 of the epoch: loss 0.25, lr 0.01, 1234 samples/s, world 3"
    assert messages[1].startswith("epoch 1/2 done: 4 steps in ")


def test_a_report_that_arrives_steps_later_names_its_own_step(caplog):
    """The reduce behind a report completes a step or more after the window closed."""
    reporter = ProgressReporter("log", epochs=3, steps_per_epoch=8, stream=io.StringIO())
    with caplog.at_level(logging.INFO, logger="elastic_ddp"):
        reporter.start_epoch(1, steps_done=0)
        for _ in range(5):
            reporter.advance()
        reporter.report(global_step=12, epoch=1, loss=0.5, lr=0.1, samples_per_second=100.0, world_size=2)
    assert caplog.records[0].getMessage().startswith("epoch 2/3, step 4/8 of the epoch: loss 0.5")


def test_on_a_terminal_progress_is_a_bar_with_the_numbers():
    terminal = _Terminal()
    reporter = ProgressReporter("auto", epochs=3, steps_per_epoch=10, stream=terminal)
    assert reporter.mode == "bar"
    reporter.start_epoch(1, steps_done=4)
    for _ in range(6):
        reporter.advance()
    reporter.report(global_step=20, epoch=1, loss=0.5, lr=0.02, samples_per_second=2048.0, world_size=4)
    reporter.end_epoch()
    text = terminal.getvalue()
    assert "\r" in text and "epoch 2/3" in text and "10/10" in text
    assert "step 20, loss 0.5, lr 0.02, 2,048 samples/s, world 4" in text


def test_other_ranks_and_off_print_nothing(caplog):
    for reporter in (ProgressReporter("bar", 1, 4, enabled=False, stream=_Terminal()),
                     ProgressReporter("off", 1, 4, stream=_Terminal())):
        with caplog.at_level(logging.INFO, logger="elastic_ddp"):
            reporter.start_epoch(0, 0)
            reporter.advance()
            reporter.report(1, 0, 1.0, 0.1, 10.0, 1)
            reporter.end_epoch()
        assert reporter.stream.getvalue() == "" and not caplog.records


def test_a_bad_mode_names_the_flag():
    with pytest.raises(ValueError, match="--progress: got 'fancy'; expected one of auto, bar, log, off"):
        ProgressReporter("fancy", 1, 1)


# ------------------------------------------------------------------------------------ real runs


def test_tensorboard_asked_for_but_missing_warns_and_training_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what an uninstalled package looks like
    with caplog.at_level(logging.WARNING, logger="elastic_ddp"):
        assert open_scalars(tmp_path / "tb", resumed_from_step=0) is None
    assert "the tensorboard package is not installed" in caplog.text
    assert open_scalars(None, resumed_from_step=0) is None
