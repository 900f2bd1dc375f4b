"""The agent <-> worker hand-off of an in-process re-form (elastic_ddp/handoff/rounds.py): each file
written by one side and read by the other, and the reader's refusals of what is not ours (links,
another user's files, open directories, torn, oversize or ill-typed JSON), none of which raises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from elastic_ddp.handoff import rounds as handoff
from elastic_ddp.handoff.rounds import ReformRequest, RoundAnnouncement

pytestmark = pytest.mark.timeout(60)
AGENT = 4242  # any pid: the directory is named after it, nothing signals it
ANNOUNCEMENT = RoundAnnouncement(round=4, group_rank=1, group_world_size=3, master_addr="10.0.0.1",
                                 master_port=29517, in_process=True, first_rank=2, world_size=5)
VALID_ROUND = {"round": 4, "group_rank": 1, "group_world_size": 3, "master_addr": "10.0.0.1",
               "master_port": 29517, "in_process": True, "joined": 0, "reason": "", "first_rank": 2, "world_size": 5}
OTHER_UID = 65534  # nobody


@pytest.fixture(autouse=True)
def private_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.fixture
def directory():
    return handoff.open_handoff(AGENT)


def write_round(directory, content) -> None:
    (directory / "round.json").write_text(content if isinstance(content, str) else json.dumps(content))


def a_dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(timeout=30)
    return process.pid


def test_the_directory_is_the_agents_own_beside_the_rendezvous_figures(tmp_path):
    assert handoff.handoff_directory(AGENT) == tmp_path / f"elastic_ddp-agent-{os.getuid()}" / f"handoff-{AGENT}"


def test_open_makes_both_levels_private_and_close_removes_them(tmp_path):
    directory = handoff.open_handoff(AGENT)
    assert directory == handoff.handoff_directory(AGENT)
    for level in (directory, directory.parent):
        assert level.stat().st_mode & 0o777 == 0o700
    handoff.declare_capable(AGENT, 0, 1)
    handoff.close_handoff(AGENT)
    assert not directory.parent.exists()
    handoff.close_handoff(AGENT)  # again: nothing left, no error


def test_close_keeps_the_parent_while_another_agent_uses_it(directory):
    other = handoff.open_handoff(AGENT + 1)
    handoff.close_handoff(AGENT)
    assert not directory.exists() and other.exists()


def test_the_round_goes_from_agent_to_workers_whole(directory):
    assert handoff.read_round(AGENT) is None, "nothing published yet"
    handoff.publish_round(AGENT, ANNOUNCEMENT)
    assert handoff.read_round(AGENT) == ANNOUNCEMENT
    assert json.loads((directory / "round.json").read_text()) == VALID_ROUND
    fallback = RoundAnnouncement(5, 0, 2, "node-a.example", 29600, in_process=False,
                                 reason="no round within 30 s\nTraceback ...")
    handoff.publish_round(AGENT, fallback)
    assert handoff.read_round(AGENT) == fallback
    assert fallback.reason == "no round within 30 s", "one line is kept"
    assert sorted(path.name for path in directory.iterdir()) == ["round.json"], "no temporary file left"


def test_capable_workers_are_counted_by_the_agent(directory):
    assert handoff.all_workers_capable(AGENT) is None, "no worker yet"
    handoff.declare_capable(AGENT, 0, 2)
    assert handoff.capable_workers(AGENT) == {0: 2}
    assert handoff.all_workers_capable(AGENT) is None, "local rank 1 has not declared"
    handoff.declare_capable(AGENT, 1, 2)
    assert handoff.all_workers_capable(AGENT) == 2
    assert json.loads((directory / "capable-1.json").read_text()) == {
        "local_rank": 1, "local_world_size": 2, "pid": os.getpid()}
    handoff.withdraw_capable(AGENT, 1)
    assert handoff.capable_workers(AGENT) == {0: 2}
    handoff.withdraw_capable(AGENT, 1)  # again, and a rank that never declared: no error
    handoff.withdraw_capable(AGENT, 4096)


def test_workers_that_disagree_on_the_local_world_size_are_not_all_capable(directory):
    handoff.declare_capable(AGENT, 0, 2)
    handoff.declare_capable(AGENT, 1, 3)
    assert handoff.all_workers_capable(AGENT) is None
    handoff.declare_capable(AGENT, 2, 3)
    assert handoff.all_workers_capable(AGENT) is None, "rank 0 still says 2"


def test_a_capable_worker_whose_process_ended_is_skipped(directory):
    handoff.declare_capable(AGENT, 0, 2)
    dead = {"local_rank": 1, "local_world_size": 2, "pid": a_dead_pid()}
    (directory / "capable-1.json").write_text(json.dumps(dead))
    assert handoff.capable_workers(AGENT) == {0: 2}
    assert handoff.all_workers_capable(AGENT) is None


def test_requests_go_from_workers_to_agent_and_are_cleared(directory):
    assert handoff.reform_requests(AGENT) == {}
    handoff.request_reform(AGENT, 0, 3, "connection reset by peer\n  at gloo ...")
    handoff.request_reform(AGENT, 1, 3, "x" * 900)
    assert handoff.reform_requests(AGENT) == {
        0: ReformRequest(3, "connection reset by peer"), 1: ReformRequest(3, "x" * 500)}
    handoff.declare_capable(AGENT, 0, 2)
    handoff.clear_requests(AGENT)
    assert handoff.reform_requests(AGENT) == {}
    assert handoff.capable_workers(AGENT) == {0: 2}, "only the requests go"


def test_open_removes_what_stopped_workers_left(directory):
    handoff.publish_round(AGENT, ANNOUNCEMENT)
    handoff.declare_capable(AGENT, 0, 1)
    handoff.request_reform(AGENT, 0, 4, "broken")
    (directory / ".round.json.1-2.tmp").write_text("{")
    os.symlink("/etc/passwd", directory / "stray-link")
    assert handoff.open_handoff(AGENT) == directory
    assert list(directory.iterdir()) == []
    assert handoff.read_round(AGENT) is None and handoff.capable_workers(AGENT) == {}
    assert handoff.reform_requests(AGENT) == {}


def test_workers_never_make_the_directory():
    with pytest.raises(FileNotFoundError):
        handoff.declare_capable(AGENT, 0, 1)
    with pytest.raises(FileNotFoundError):
        handoff.request_reform(AGENT, 0, 1, "broken")
    assert not handoff.handoff_directory(AGENT).parent.exists()
    handoff.withdraw_capable(AGENT, 0)
    handoff.clear_requests(AGENT)
    assert handoff.read_round(AGENT) is None and handoff.reform_requests(AGENT) == {}
    with pytest.raises(FileNotFoundError):
        handoff.publish_round(AGENT, ANNOUNCEMENT)


@pytest.mark.parametrize("level", ["handoff", "parent"])
def test_a_directory_others_may_enter_is_refused_on_both_sides(directory, level):
    handoff.publish_round(AGENT, ANNOUNCEMENT)
    handoff.request_reform(AGENT, 0, 3, "broken")
    (directory if level == "handoff" else directory.parent).chmod(0o755)
    with pytest.raises(PermissionError):
        handoff.publish_round(AGENT, ANNOUNCEMENT)
    with pytest.raises(PermissionError):
        handoff.declare_capable(AGENT, 0, 1)
    with pytest.raises(PermissionError):
        handoff.open_handoff(AGENT)
    assert handoff.read_round(AGENT) is None
    assert handoff.reform_requests(AGENT) == {}


def test_a_link_in_place_of_the_directory_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    handoff.handoff_directory(AGENT).parent.mkdir(mode=0o700)
    os.symlink(target, handoff.handoff_directory(AGENT))
    with pytest.raises(PermissionError):
        handoff.open_handoff(AGENT)
    write_round(target, VALID_ROUND)
    assert handoff.read_round(AGENT) is None


def test_a_link_named_round_json_is_not_followed(directory, tmp_path):
    real = tmp_path / "real.json"
    real.write_text(json.dumps(VALID_ROUND))
    os.symlink(real, directory / "round.json")
    assert handoff.read_round(AGENT) is None
    os.symlink(real, directory / "request-0.json")
    assert handoff.reform_requests(AGENT) == {}


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_files_of_another_user_are_refused(directory):
    handoff.publish_round(AGENT, ANNOUNCEMENT)
    handoff.declare_capable(AGENT, 0, 1)
    handoff.request_reform(AGENT, 0, 3, "broken")
    for path in directory.iterdir():
        os.chown(path, OTHER_UID, OTHER_UID)
    assert handoff.read_round(AGENT) is None
    assert handoff.capable_workers(AGENT) == {}
    assert handoff.reform_requests(AGENT) == {}


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_of_another_user_is_refused(directory):
    handoff.publish_round(AGENT, ANNOUNCEMENT)
    os.chown(directory, OTHER_UID, OTHER_UID)
    assert handoff.read_round(AGENT) is None
    with pytest.raises(PermissionError):
        handoff.publish_round(AGENT, ANNOUNCEMENT)


@pytest.mark.parametrize("content", [
    "",
    '{"round": 4, "group_rank": 1',  # torn
    "not json",
    b"\xff\xfe{}".decode("latin-1"),
    "[" * 10000 + "]" * 10000,  # nested past the parser's recursion limit
    "[]",
    "null",
])
def test_a_round_file_that_is_not_our_json_is_no_round(directory, content):
    write_round(directory, content)
    assert handoff.read_round(AGENT) is None


def test_a_round_file_nested_deep_within_the_size_limit_is_no_round(directory):
    deep = "[" * 2000 + "]" * 2000
    assert len(deep) <= handoff.MAX_FILE_BYTES
    write_round(directory, deep)
    assert handoff.read_round(AGENT) is None


@pytest.mark.parametrize("change", [
    {"round": True},
    {"round": -1},
    {"round": 4.0},
    {"round": "4"},
    {"group_rank": -1},
    {"group_rank": 3},  # = group_world_size
    {"group_world_size": 0},
    {"in_process": 1},
    {"in_process": None},
    {"joined": -1},
    {"joined": 3},  # = group_world_size: at least one node was in the group before
    {"joined": True},
    {"master_port": 0},
    {"master_port": 70000},
    {"master_port": False},
    {"master_addr": ""},
    {"master_addr": "10.0.0.1 10.0.0.2"},
    {"master_addr": "h" * 256},
    {"master_addr": 167772161},
    {"reason": "two\nlines"},
    {"reason": "r" * 501},
    {"reason": None},
    {"extra": 1},
])
def test_a_round_with_a_wrong_field_is_no_round(directory, change):
    write_round(directory, {**VALID_ROUND, **change})
    assert handoff.read_round(AGENT) is None


@pytest.mark.parametrize("missing", sorted(VALID_ROUND))
def test_a_round_without_a_field_is_no_round(directory, missing):
    write_round(directory, {key: value for key, value in VALID_ROUND.items() if key != missing})
    assert handoff.read_round(AGENT) is None


def test_a_file_over_the_size_limit_is_refused_even_if_valid(directory):
    padded = json.dumps(VALID_ROUND) + " " * handoff.MAX_FILE_BYTES
    write_round(directory, padded)
    assert json.loads(padded) == VALID_ROUND
    assert handoff.read_round(AGENT) is None


def test_a_directory_or_fifo_named_round_json_is_no_round_and_does_not_block(directory):
    os.mkfifo(directory / "round.json")
    assert handoff.read_round(AGENT) is None
    os.unlink(directory / "round.json")
    (directory / "round.json").mkdir()
    assert handoff.read_round(AGENT) is None


@pytest.mark.parametrize("name, fields", [
    ("capable-1.json", {"local_rank": 0, "local_world_size": 2, "pid": os.getpid()}),  # not its own name
    ("capable-0.json", {"local_rank": 0, "local_world_size": 0, "pid": os.getpid()}),
    ("capable-2.json", {"local_rank": 2, "local_world_size": 2, "pid": os.getpid()}),
    ("capable-0.json", {"local_rank": False, "local_world_size": 1, "pid": os.getpid()}),
    ("capable-0.json", {"local_rank": 0, "local_world_size": 1, "pid": True}),
    ("capable-0.json", {"local_rank": 0, "local_world_size": 1, "pid": 0}),
    ("capable-0.json", {"local_rank": 0, "local_world_size": 1, "pid": 2**64}),
    ("capable-0.json", {"local_rank": 0, "local_world_size": 1}),
    ("capable-00.json", {"local_rank": 0, "local_world_size": 1, "pid": os.getpid()}),
    ("capable-4096.json", {"local_rank": 4096, "local_world_size": 4097, "pid": os.getpid()}),
    ("capable--1.json", {"local_rank": -1, "local_world_size": 1, "pid": os.getpid()}),
    ("capable-0.json.tmp", {"local_rank": 0, "local_world_size": 1, "pid": os.getpid()}),
])
def test_an_invalid_capable_mark_is_skipped(directory, name, fields):
    (directory / name).write_text(json.dumps(fields))
    assert handoff.capable_workers(AGENT) == {}


@pytest.mark.parametrize("name, content", [
    ("request-0.json", {"broken_round": -1, "reason": ""}),
    ("request-0.json", {"broken_round": True, "reason": ""}),
    ("request-0.json", {"broken_round": 3, "reason": 3}),
    ("request-0.json", {"broken_round": 3, "reason": "a\rb"}),
    ("request-0.json", {"broken_round": 3}),
    ("request-0.json", {"broken_round": 3, "reason": "", "round": 3}),
    ("request-0.json", "[" * 10000 + "]" * 10000),
    ("request-0.json", "{"),
    ("request-x.json", {"broken_round": 3, "reason": ""}),
    ("request-0", {"broken_round": 3, "reason": ""}),
])
def test_an_invalid_request_is_skipped(directory, name, content):
    (directory / name).write_text(content if isinstance(content, str) else json.dumps(content))
    assert handoff.reform_requests(AGENT) == {}


@pytest.mark.parametrize("call", [
    lambda: handoff.declare_capable(AGENT, 2, 2),
    lambda: handoff.declare_capable(AGENT, -1, 2),
    lambda: handoff.declare_capable(AGENT, 0, 0),
    lambda: handoff.declare_capable(AGENT, True, 2),
    lambda: handoff.request_reform(AGENT, 4096, 3, "broken"),
    lambda: handoff.request_reform(AGENT, 0, -1, "broken"),
    lambda: handoff.request_reform(AGENT, 0, 3, None),
])
def test_writers_refuse_values_out_of_range(directory, call):
    with pytest.raises((TypeError, ValueError)):
        call()
    assert list(directory.iterdir()) == [], "nothing written"


@pytest.mark.parametrize("change", [
    {"round": -1}, {"group_rank": 3}, {"group_world_size": True}, {"master_port": 0}, {"master_port": 65536},
    {"master_addr": ""}, {"in_process": "yes"}, {"joined": 3}, {"reason": None},
    {"first_rank": None}, {"first_rank": 0}, {"first_rank": 5}, {"world_size": None}, {"world_size": 2},
])
def test_an_announcement_out_of_range_cannot_be_made(change):
    fields = {**VALID_ROUND, **change}
    with pytest.raises((TypeError, ValueError), match=next(iter(change))):
        RoundAnnouncement(**fields)
