"""The rendezvous (what `--rdzv_backend=etcd-v3` runs) against a real etcd, several handlers in
threads of this process (each one an agent: a lease, keys and a lease-refresh thread of its own).

Also the integration cases of torch's test/distributed/elastic/rendezvous/dynamic_rendezvous_test.py
that apply to any handler, adapted: all nodes join, the redundancy list, a spare moving into the
next round when a member leaves, get_backend/get_run_id/use_agent_store, set_closed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from elastic_ddp.agent.rendezvous.boards.etcd import create_etcd_v3_handler
from elastic_ddp.agent.rendezvous.handler import RoundRendezvousHandler
from elastic_ddp.agent.rendezvous.plugin import etcd_v3_handler_factory
from elastic_ddp.testbed.local_cluster import wait_for
from tests.support.rendezvous import Background, assert_one_world, rendezvous_together

pytestmark = pytest.mark.timeout(90)

FAST = {"join_timeout": "30", "last_call_timeout": "0.5", "keep_alive_interval": "0.5",
        "keep_alive_max_attempt": "4"}


def params(endpoint: str, run_id: str, min_nodes: int, max_nodes: int, **conf: Any) -> RendezvousParameters:
    return RendezvousParameters("etcd-v3", endpoint, run_id, min_nodes, max_nodes, **{**FAST, **conf})


@pytest.fixture
def make_handlers(shared_etcd_server, run_id):
    """Handlers of this test's own run id on the module's etcd member (a fresh one costs ~1 s a test)."""
    made: list[RoundRendezvousHandler] = []

    def make(count: int, min_nodes: int, max_nodes: int, **conf: Any) -> list[RoundRendezvousHandler]:
        handlers = [create_etcd_v3_handler(params(shared_etcd_server.endpoint, run_id, min_nodes, max_nodes,
                                                        **conf))
                    for _ in range(count)]
        made.extend(handlers)
        return handlers

    yield make
    for handler in made:
        handler.shutdown()


def test_all_nodes_join_rendezvous_in_one_round_ranked_by_node_name(make_handlers) -> None:
    handlers = make_handlers(3, 3, 3)
    infos = rendezvous_together(handlers, timeout=30)
    assert_one_world(infos, 3)
    by_rank = sorted(zip(infos, handlers, strict=True), key=lambda pair: pair[0].rank)
    names = [handler.node for _, handler in by_rank]
    assert names == sorted(names)  # torch's rank order: sorted node names
    assert len({info.bootstrap_store_info.master_port for info in infos}) == 1
    counts = handlers[0]._board.counts
    assert counts["writes"] <= 3 and counts["closes"] <= 1  # lease + liveness, one arrival; maybe the close


def test_a_node_whose_lease_is_revoked_is_left_out_of_the_next_round(make_handlers) -> None:
    handlers = make_handlers(3, 2, 3)
    assert_one_world(rendezvous_together(handlers, timeout=30), 3)
    killed, survivors = handlers[0], handlers[1:]
    killed._board.leave()  # as etcd does when a killed agent's lease expires
    first = Background(survivors[0])
    wait_for(lambda: survivors[1].num_nodes_waiting() == 1, 10, "a survivor waiting")  # its workers would stop now
    second = Background(survivors[1])
    assert_one_world([first.result(), second.result()], 2)


def test_a_killed_node_is_left_out_once_its_lease_expires(make_handlers) -> None:
    handlers = make_handlers(3, 2, 3, probe_dead_nodes="0")
    assert_one_world(rendezvous_together(handlers, timeout=30), 3)
    handlers[0]._board._stop.set()  # its refreshes stop, as when the agent is SIGKILLed
    started = time.monotonic()
    infos = rendezvous_together(handlers[1:], timeout=30)
    assert_one_world(infos, 2)
    assert time.monotonic() - started < 2 * 2 + 3  # lease ttl 2 s (0.5 s x 4), then the round


def test_a_killed_node_whose_beacon_refuses_is_left_out_before_its_lease_expires(make_handlers) -> None:
    handlers = make_handlers(3, 2, 3, keep_alive_interval="1", keep_alive_max_attempt="20")  # a 20 s lease
    assert_one_world(rendezvous_together(handlers, timeout=30), 3)
    killed, survivors = handlers[0], handlers[1:]
    port = killed._witness.port
    wait_for(lambda: all((killed.node, port) in s._witness._reached for s in survivors), 10,
             "the survivors to reach the killed node's beacon")
    killed._board._stop.set()  # no more refreshes, and the beacon closes: as a SIGKILLed agent's
    killed._witness.close()
    started = time.monotonic()
    assert_one_world(rendezvous_together(survivors, timeout=30), 2)
    assert time.monotonic() - started < 5, "the survivors waited for the killed node's lease"


def test_a_joining_node_makes_the_members_restart_and_is_in_the_next_round(make_handlers) -> None:
    members = make_handlers(2, 2, 3)
    assert_one_world(rendezvous_together(members, timeout=30), 2)
    joiner = Background(make_handlers(1, 2, 3)[0])
    wait_for(lambda: all(member.num_nodes_waiting() == 1 for member in members), 10, "the joiner waiting")
    infos = rendezvous_together(members, timeout=30)
    assert_one_world([*infos, joiner.result()], 3)


def test_redundancy_list_then_a_spare_takes_a_place_when_a_member_leaves(make_handlers) -> None:
    members = make_handlers(2, 1, 2)
    assert_one_world(rendezvous_together(members, timeout=30), 2)
    spare = Background(make_handlers(1, 1, 2)[0])
    wait_for(lambda: len(members[0]._board.waiting(1)) == 1, 10, "the spare waiting")
    assert [member.num_nodes_waiting() for member in members] == [0, 0]  # a full world does not restart
    with pytest.raises(TimeoutError):  # three last calls pass and the spare forms no round of its own
        wait_for(lambda: members[0]._board.view(1).record.round > 0, 1.5, "a round of the spare alone")
    assert spare.thread.is_alive()
    members[0]._board.leave()  # a member gone (its lease revoked); shutdown would close the run for everyone
    infos = rendezvous_together(members[1:], timeout=30)
    assert_one_world([*infos, spare.result()], 2)


def test_too_few_nodes_time_out_with_a_clear_error(make_handlers) -> None:
    handler = make_handlers(1, 2, 2, join_timeout="1")[0]
    with pytest.raises(RendezvousTimeoutError, match="join_timeout=1"):
        handler.next_rendezvous()


def test_set_closed_ends_waiting_and_later_rendezvous(make_handlers) -> None:
    first, second = make_handlers(2, 3, 3)
    waiting = Background(first)
    wait_for(lambda: first._board.view(0).arrived == 1, 10, "the first arrival")
    assert not second.is_closed()
    second.set_closed()
    assert isinstance(waiting.result(), RendezvousClosedError)
    assert first.is_closed()
    with pytest.raises(RendezvousClosedError):
        second.next_rendezvous()


def test_handler_contract_names_and_store(make_handlers, run_id) -> None:
    handler = make_handlers(1, 1, 1)[0]
    assert handler.get_backend() == "etcd-v3"
    assert handler.get_run_id() == run_id
    assert handler.use_agent_store is False
    assert handler.num_nodes_waiting() == 0
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    info.store.set("key", b"value")
    assert info.store.get("key") == b"value"
    assert handler.shutdown() is True


def test_the_entry_point_builds_our_handler_and_refuses_any_other_algorithm(shared_etcd_server,
                                                                                 run_id) -> None:
    create = etcd_v3_handler_factory()
    for conf in ({}, {"algorithm": "keyed"}):
        handler = create(params(shared_etcd_server.endpoint, run_id, 1, 1, **conf))
        try:
            assert isinstance(handler, RoundRendezvousHandler), conf
        finally:
            handler.shutdown()
    with pytest.raises(ValueError, match="--rdzv_conf algorithm: got 'fancy'; expected keyed "):
        create(params(shared_etcd_server.endpoint, run_id, 1, 1, algorithm="fancy"))
    with pytest.raises(ValueError, match="--rdzv_conf algorithm: got 'dynamic', which was removed"):
        create(params(shared_etcd_server.endpoint, run_id, 1, 1, algorithm="dynamic"))


def test_nodes_waiting_for_a_round_for_longer_than_their_lease_stay_in_it(make_handlers) -> None:
    """Two of three nodes (min_nodes 3) wait for two lease TTLs (2 s each): the lease-refresh threads
    keep both arrivals all along, and the third one's arrival closes the round with all three."""
    first, second, third = make_handlers(3, 3, 3, keep_alive_interval="1", keep_alive_max_attempt="2")
    waiting = [Background(first), Background(second)]
    wait_for(lambda: first._board.view(0).arrived == 2, 10, "two arrivals")
    outlived = time.monotonic() + 2 * first._settings.lease_ttl

    def both_kept_for_two_leases() -> bool:
        assert first._board.view(0).arrived == 2, "an arrival went with its lease"
        return time.monotonic() >= outlived

    wait_for(both_kept_for_two_leases, 10, "two lease TTLs to pass")
    waiting.append(Background(third))
    assert_one_world([each.result() for each in waiting], 3)


def test_a_forged_round_record_is_refused_not_executed(make_handlers) -> None:
    handler = make_handlers(1, 1, 1)[0]
    board = handler._board
    board._connection.call("forge", lambda client: client.put(board._base + "record", b"\x80\x04cos\nsystem\n."))
    with pytest.raises(Exception, match="round record .* is not valid"):
        handler.next_rendezvous()


def _one_node_round(handler: RoundRendezvousHandler) -> None:
    try:
        assert handler.next_rendezvous().rank == 0
    finally:
        assert handler.shutdown()


def test_over_tls(tls_etcd_server, run_id) -> None:
    assert tls_etcd_server.tls is not None
    _one_node_round(create_etcd_v3_handler(params(tls_etcd_server.endpoint, run_id, 1, 1, protocol="https",
                                                        ca_cert=str(tls_etcd_server.tls.ca_cert))))


def test_with_auth(auth_etcd_server, run_id, tmp_path) -> None:
    (tmp_path / "password").write_text(f"{auth_etcd_server.auth_password}\n")
    _one_node_round(create_etcd_v3_handler(params(auth_etcd_server.endpoint, run_id, 1, 1, user="root",
                                                        password_file=str(tmp_path / "password"))))


def test_members_ride_out_an_etcd_restart_and_meet_again(etcd_server, run_id) -> None:
    handlers = [create_etcd_v3_handler(params(etcd_server.endpoint, run_id, 2, 2)) for _ in range(2)]
    try:
        assert_one_world(rendezvous_together(handlers, timeout=30), 2)
        etcd_server.restart(down_for=3.0)  # longer than the 2 s node lease: etcd renews leases on restart
        assert [handler.num_nodes_waiting() for handler in handlers] == [0, 0]
        assert_one_world(rendezvous_together(handlers, timeout=60), 2)
    finally:
        for handler in handlers:
            handler.shutdown()


def test_a_round_forms_after_the_etcd_leader_is_killed(etcd_cluster, run_id) -> None:
    handlers = [create_etcd_v3_handler(params(etcd_cluster.endpoints, run_id, 2, 2)) for _ in range(2)]
    try:
        assert_one_world(rendezvous_together(handlers, timeout=30), 2)
        leader = etcd_cluster.leader()
        leader.stop()  # SIGKILL
        assert_one_world(rendezvous_together(handlers, timeout=60), 2)
    finally:
        for handler in handlers:
            handler.shutdown()


def test_an_arrival_on_an_expired_node_lease_takes_a_new_lease(make_handlers) -> None:
    """Found with 256 agents as threads (benchmarks/rendezvous_threads.py): a node whose lease had
    expired (its refreshes starved) retried its arrival on the dead lease until the retry budget
    (here 5 s) ended, and its agent failed. It takes a new lease and writes its keys again."""
    handler = make_handlers(1, 1, 1, retry_timeout="5")[0]
    board = handler._board
    board.start(handler.node, handler._witness.port)
    board._stop.set()  # no refresh repairs it first
    board._connection.call("revoke", lambda client: client.revoke_lease(board._lease))  # as etcd does at expiry
    assert handler.next_rendezvous().world_size == 1
    assert handler.node in board.alive()
