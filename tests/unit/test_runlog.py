"""The event log's one schema: every kind is declared once, written only as declared, read by the
one reader, and known to the report (so no event the trainer writes is left out of it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from elastic_ddp.runlog import run_history, schema
from elastic_ddp.runlog.events import EventLog
from elastic_ddp.runlog.reader import EventFollower, parse_event, read_events

REPO = Path(__file__).resolve().parents[2]


def test_the_report_knows_every_declared_kind():
    assert set(run_history.RECORDERS) == set(schema.EVENT_KINDS), (
        "a kind of runlog/schema.py has no entry in runlog.run_history.RECORDERS: the report would not show it")


def test_every_kind_the_package_emits_is_declared_and_every_declared_kind_is_emitted():
    source = "\n".join(path.read_text() for path in (REPO / "elastic_ddp").rglob("*.py"))
    emitted = set(re.findall(r"\.emit\(\s*schema\.([A-Z_]+)\b", source))
    declared = {name for name, value in vars(schema).items() if isinstance(value, schema.EventKind)}
    assert emitted == declared


def test_operations_md_lists_every_kind_with_its_fields():
    text = (REPO / "docs" / "operations.md").read_text()
    for kind in schema.EVENT_KINDS.values():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{kind.name}` |")), None)
        assert row is not None, f"docs/operations.md has no row for `{kind.name}`"
        missing = [field for field in kind.fields if f"`{field}`" not in row]
        assert not missing, f"docs/operations.md: `{kind.name}` lacks {missing}"


def test_an_undeclared_kind_or_field_is_refused_by_the_writer(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", incarnation=1, enabled=True)
    with pytest.raises(AssertionError):
        log.emit(schema.EventKind("mystery", (), "not declared"))
    with pytest.raises(AssertionError):
        log.emit(schema.STEP, global_step=1)  # lacks epoch
    with pytest.raises(AssertionError):
        log.emit(schema.STEP, global_step=1, epoch=0, extra=2)
    log.emit(schema.STEP, global_step=1, epoch=0)
    log.close()
    [event] = read_events(tmp_path / "events.jsonl")
    assert event["event"] == "step" and event["incarnation"] == 1 and event.keys() == {
        "time", "event", "incarnation", "global_step", "epoch"}


def test_a_disabled_log_checks_but_writes_nothing(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", incarnation=1, enabled=False)
    log.emit(schema.STEP, global_step=1, epoch=0)
    with pytest.raises(AssertionError):
        log.emit(schema.STEP, global_step=1)
    assert not (tmp_path / "events.jsonl").exists()


@pytest.mark.parametrize("line", [b"", b"{", b"[1, 2]", b"null", b'"text"', b"\xff\xfe", b'{"event": "x"}',
                                  b'{"time": 1, "event": "x"}'])
def test_the_one_parser_drops_lines_that_are_not_events(line):
    assert parse_event(line) is None


def test_the_follower_and_the_whole_file_reader_agree(tmp_path):
    path = tmp_path / "events.jsonl"
    lines = [{"time": 1.0, "event": "start", "incarnation": 1, "ranks": [{"agent_pid": 5}]},
             {"time": 1.5, "event": "step", "incarnation": 1, "global_step": 1, "epoch": 0},
             {"time": 2.0, "event": "snapshot", "incarnation": 1, "global_step": 1}]
    follower = EventFollower(path)
    with open(path, "w") as handle:
        for line in lines:
            handle.write(json.dumps(line) + "\n")
        handle.write('{"time": 3, "event": "st')  # a torn last line: not yet
    seen = follower.poll()
    assert seen == read_events(path) == lines
    assert follower.newest_step() == 1 and follower.newest_group().agent_pids == {5}
    assert [e["event"] for e in follower.of_kind(schema.SNAPSHOT)] == ["snapshot"]
