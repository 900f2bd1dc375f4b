"""The agent's rendezvous rounds as metrics: counted around `next_rendezvous` in the agent
(elastic_ddp/agent/rendezvous_metrics.py), written to a file, served by the node's metrics server
(elastic_ddp/runlog/metrics_agent.py). The two sides import nothing of each other; the file is
their contract, in one module of its own (elastic_ddp/handoff/rendezvous_figures.py). A real agent and server are in tests/cluster/test_metrics_endpoint.py."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elastic_ddp.agent import rendezvous_metrics as agent_side
from elastic_ddp.handoff import rendezvous_figures as figures_file
from elastic_ddp.runlog import metrics_agent as server_side
from elastic_ddp.runlog.metrics_server import node_registry

pytestmark = pytest.mark.timeout(60)
NAME = "elastic_ddp_agent_rendezvous"


@pytest.fixture(autouse=True)
def private_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


class StandInHandler:
    """Stands for torch's handler: its rounds wait for the test, or raise."""

    def __init__(self):
        self.proceed = threading.Event()
        self.entered = threading.Event()
        self.fail = False

    def next_rendezvous(self):
        self.entered.set()
        assert self.proceed.wait(10)
        if self.fail:
            raise RuntimeError("closed")
        return "round info"


def served(pid: int, directory) -> dict[str, float]:
    text = generate_latest(node_registry(directory, pid)).decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith(NAME)}


def test_the_file_is_the_users_own_per_agent():
    assert figures_file.rendezvous_file(1234).parent.name == f"elastic_ddp-agent-{os.getuid()}"
    assert figures_file.rendezvous_file(1234).name == "rendezvous-1234.json"


def test_rounds_and_their_seconds_are_served_while_and_after_they_run(tmp_path):
    handler = agent_side.count_rounds(StandInHandler())
    pid = os.getpid()
    assert served(pid, tmp_path) == {f"{NAME}_rounds_total": 0, f"{NAME}_failures_total": 0,
                                     f"{NAME}_seconds_total": 0, f"{NAME}_last_round_seconds": 0,
                                     f"{NAME}_in_progress": 0}, "the file exists from the handler's creation"
    results = []
    round_thread = threading.Thread(target=lambda: results.append(handler.next_rendezvous()))
    round_thread.start()
    assert handler.entered.wait(10)
    during = served(pid, tmp_path)
    assert during[f"{NAME}_in_progress"] == 1 and during[f"{NAME}_rounds_total"] == 0
    handler.proceed.set()
    round_thread.join(10)
    after = served(pid, tmp_path)
    assert results == ["round info"]
    assert after[f"{NAME}_in_progress"] == 0 and after[f"{NAME}_rounds_total"] == 1
    assert after[f"{NAME}_seconds_total"] >= during[f"{NAME}_seconds_total"], "a counter never goes down"
    assert after[f"{NAME}_last_round_seconds"] > 0
    assert after[f"{NAME}_seconds_total"] == pytest.approx(after[f"{NAME}_last_round_seconds"], abs=1e-5)

    handler.fail = True
    with pytest.raises(RuntimeError, match="closed"):
        handler.next_rendezvous()
    failed = served(pid, tmp_path)
    assert failed[f"{NAME}_failures_total"] == 1 and failed[f"{NAME}_rounds_total"] == 1
    assert set(failed) == server_side.exposed_names()


def test_nothing_is_served_for_another_agent_or_a_torn_or_foreign_file(tmp_path):
    assert served(os.getpid(), tmp_path) == {}, "no file yet"
    path = figures_file.rendezvous_file(os.getpid())
    path.parent.mkdir(mode=0o700)
    path.write_text('{"pid": 1, "rounds": 3}')
    assert served(os.getpid(), tmp_path) == {}, "the figures of another pid"
    path.write_text('{"pid": ')
    assert served(os.getpid(), tmp_path) == {}, "a torn file"
    server_side.remove_agent_file(os.getpid())
    assert not path.exists()


def test_a_directory_others_can_write_is_refused_and_the_agent_goes_on(tmp_path, caplog):
    directory = figures_file.rendezvous_file(os.getpid()).parent
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)
    handler = agent_side.count_rounds(StandInHandler())
    handler.proceed.set()
    assert handler.next_rendezvous() == "round info", "the agent's round is unharmed"
    assert "rendezvous metrics: cannot write" in caplog.text
    assert not figures_file.rendezvous_file(os.getpid()).exists()


def test_the_files_of_agents_that_no_longer_run_are_removed_by_the_next_agent():
    dead = figures_file.rendezvous_file(2**22 + 1)  # above Linux's largest pid_max: never a running process
    alive = figures_file.rendezvous_file(os.getppid())
    dead.parent.mkdir(mode=0o700)
    for path in (dead, alive):
        path.write_text("{}")
    agent_side.count_rounds(StandInHandler())
    assert not dead.exists() and alive.exists() and figures_file.rendezvous_file(os.getpid()).exists()


def test_the_directory_goes_with_the_last_agents_file_and_a_write_racing_that_is_not_lost(monkeypatch):
    mine, other = figures_file.rendezvous_file(os.getpid()), figures_file.rendezvous_file(os.getppid())
    rounds = agent_side.RendezvousRounds(mine)
    rounds.write()
    other.write_text("{}")
    rounds.remove()
    assert not mine.exists() and other.exists(), "another agent's file keeps the directory"
    server_side.remove_agent_file(os.getppid())
    assert not mine.parent.exists(), "the metrics server removed the last file, and the directory"
    rounds = agent_side.RendezvousRounds(mine)
    made, removed = figures_file.make_private_directory, []

    def made_then_removed(directory):  # another agent exits between this one's mkdir and its write, once
        made(directory)
        if not removed:
            removed.append(directory)
            directory.rmdir()
    monkeypatch.setattr(figures_file, "make_private_directory", made_then_removed)
    rounds.write()
    assert removed, "the race was played"
    assert json.loads(mine.read_text())["pid"] == os.getpid()
    rounds.remove()
    assert not mine.parent.exists()


def test_the_seconds_served_never_go_down_when_a_round_ends_between_a_scrape_and_its_write():
    """A scrape just after a round ended, before the agent wrote its end, adds the round's time up to
    the scrape: slightly more than the agent then records (seen in a CI run: 1.7063 s, then 1.7048 s)."""
    pid = os.getpid()
    path = figures_file.rendezvous_file(pid)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    collector = server_side.AgentRendezvousCollector(pid)

    def scrape(figures: dict) -> float:
        path.write_text(json.dumps({"pid": pid, "rounds": 1, "failures": 0, "last_round_seconds": 0.5, **figures}))
        return next(sample.value for family in collector.collect() for sample in family.samples
                    if sample.name == f"{NAME}_seconds_total")

    during = scrape({"seconds": 1.0, "round_started": time.time() - 0.2})  # served: about 1.2
    after = scrape({"seconds": 1.0 + 0.19, "round_started": None})  # the agent's own measure: 0.19
    assert after >= during > 1.19
    assert scrape({"seconds": 5.0, "round_started": None}) == 5.0, "the total is served again once it passes"


class InProcessStandIn(StandInHandler):
    """Stands for our handler's in-process rounds: 0 when this node's workers re-formed in the round."""

    def __init__(self, answers: list[int]):
        super().__init__()
        self.answers = answers

    def reform_in_process(self, current, count):
        return self.answers.pop(0)


def test_a_round_run_in_process_counts_and_one_given_up_counts_its_time_only(tmp_path):
    handler = agent_side.count_rounds(InProcessStandIn([0, 1]))
    pid = os.getpid()
    assert handler.reform_in_process("round 3", 0) == 0  # the workers re-formed in round 4
    taken = served(pid, tmp_path)
    assert taken[f"{NAME}_rounds_total"] == 1 and taken[f"{NAME}_failures_total"] == 0
    assert handler.reform_in_process("round 4", 0) == 1  # given up: torchrun's restart enters it
    given_up = served(pid, tmp_path)
    assert given_up[f"{NAME}_rounds_total"] == 1 and given_up[f"{NAME}_failures_total"] == 0
    assert given_up[f"{NAME}_seconds_total"] >= taken[f"{NAME}_seconds_total"] > 0
    assert given_up[f"{NAME}_in_progress"] == 0
