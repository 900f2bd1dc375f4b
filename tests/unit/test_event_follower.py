"""The event-log follower (elastic_ddp/runlog/reader.py) as the chaos harness uses it, on a log
written by hand: complete new lines only, indexed by worker group.

    .venv/bin/python -m pytest -q tests/unit/test_event_follower.py
"""

from __future__ import annotations

import json

from elastic_ddp.runlog.reader import EventFollower


def test_the_follower_reads_only_complete_new_lines(tmp_path):
    log = tmp_path / "events.jsonl"
    follower = EventFollower(log)
    assert follower.poll() == []
    start = {"time": 10.0, "event": "start", "incarnation": 1, "world_size": 2,
             "ranks": [{"rank": 0, "agent_pid": 100}, {"rank": 1, "agent_pid": 200}]}
    step = {"time": 11.0, "event": "step", "incarnation": 1, "global_step": 1}
    with open(log, "w") as handle:
        handle.write(json.dumps(start) + "\n" + json.dumps(step)[:20])  # the step line is half written
    assert [e["event"] for e in follower.poll()] == ["start"]
    with open(log, "a") as handle:
        handle.write(json.dumps(step)[20:] + "\n" + "{torn\n")
    assert [e["event"] for e in follower.poll()] == ["step"]
    group = follower.groups[1]
    assert group.agent_pids == {100, 200} and group.first_step["global_step"] == 1
    assert follower.newest_step() == 1 and follower.groups_since(10.5) == []
