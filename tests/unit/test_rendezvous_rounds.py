"""The rendezvous's parts without a board: the completion rule, who is in a round, the JSON schema,
how nodes are named."""

from __future__ import annotations

import json
import os
import socket

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.agent.rendezvous.agent_setup import local_node
from elastic_ddp.agent.rendezvous.plugin import take_algorithm
from elastic_ddp.agent.rendezvous.rounds import RendezvousSettings, closed_round, may_close, waiting_count
from elastic_ddp.agent.rendezvous.state import (
    NodeDesc,
    RoundRecord,
    decode_alive,
    decode_arrival,
    decode_heartbeat,
    decode_record,
    encode_arrival,
    node_name,
)

A, B, C, D = (NodeDesc(f"host{i}", 100 + i, 0) for i in range(4))


def settings(min_nodes: int = 2, max_nodes: int = 3, prompt: bool = True) -> RendezvousSettings:
    return RendezvousSettings("run", min_nodes, max_nodes, join_timeout=30, last_call_timeout=1, keep_alive_interval=1,
                         keep_alive_max_attempt=5, prompt_completion=prompt)


def test_a_first_round_waits_for_min_nodes_then_a_quiet_last_call() -> None:
    assert not may_close([A], None, set(), settings(), quiet_for=10)
    assert not may_close([A, B], None, set(), settings(), quiet_for=0.5)
    assert may_close([A, B], None, set(), settings(), quiet_for=1.0)
    assert may_close([A, B, C], None, set(), settings(), quiet_for=0)  # max_nodes: at once


def test_a_live_member_of_the_last_round_that_has_not_arrived_holds_the_round() -> None:
    last = RoundRecord(0, (A, B, C))
    assert not may_close([A, B], last, {A, B, C}, settings(), quiet_for=60)
    assert not may_close([A, B, D], last, {A, B, C, D}, settings(), quiet_for=60)  # not even at max_nodes
    assert may_close([A, B], last, {A, B}, settings(), quiet_for=0)  # C is dead: prompt completion
    assert not may_close([A, B], last, {A, B}, settings(prompt=False), quiet_for=0.5)
    assert may_close([A, B], last, {A, B}, settings(prompt=False), quiet_for=1)


def test_members_keep_their_places_spares_wait_and_ranks_follow_node_names() -> None:
    record = closed_round(1, [D, C, A], RoundRecord(0, (A, C)), max_nodes=2)
    assert record == RoundRecord(1, (A, C), (D,))
    assert closed_round(0, [C, A, B], None, max_nodes=3).members == (A, B, C)


def test_only_a_member_or_room_in_the_world_makes_waiting_nodes_count() -> None:
    full = RoundRecord(0, (A, B))
    assert waiting_count([C], full, max_nodes=2) == 0
    assert waiting_count([C, A], full, max_nodes=2) == 2
    assert waiting_count([C], full, max_nodes=3) == 1
    assert waiting_count([], full, max_nodes=3) == 0


def test_records_and_arrivals_round_trip_and_anything_else_is_refused() -> None:
    record = RoundRecord(7, (A, B), (C,))
    assert decode_record(record.encode()) == record
    assert decode_arrival(encode_arrival(A)) == A
    pickled = b"\x80\x04cos\nsystem\n."
    refused = [pickled, b"{}", b"[]", json.dumps({"round": -1, "members": [], "spares": []}).encode(),
               json.dumps({"round": 1, "members": [{"addr": "h", "pid": 1, "local_id": 0}] * 2, "spares": []}).encode(),
               json.dumps({"round": 1, "members": [{"addr": "h", "pid": "1", "local_id": 0}], "spares": []}).encode(),
               json.dumps({"round": True, "members": [{"addr": "h", "pid": 1, "local_id": 0}], "spares": []}).encode()]
    assert [decode_record(value) for value in refused] == [None] * len(refused)
    assert decode_arrival(b"x" * 2000) is None
    assert decode_arrival(pickled) is None


def test_a_node_is_named_by_address_pid_and_counter_hashable_ordered_and_printable() -> None:
    node = NodeDesc("host", 42, 0)
    assert node == NodeDesc("host", 42, 0) and len({node, NodeDesc("host", 42, 0)}) == 1
    assert sorted([NodeDesc("b", 1, 0), NodeDesc("a", 2, 1), NodeDesc("a", 2, 0), NodeDesc("a", 10, 0)]) == [
        NodeDesc("a", 2, 0), NodeDesc("a", 2, 1), NodeDesc("a", 10, 0), NodeDesc("b", 1, 0)]  # field by field
    assert str(node) == repr(node) == node_name(node) == "host_42_0"  # the name torch prints, as ours do
    # The wire format every node of a run must share (key names and values): as it was with torch's node.
    assert encode_arrival(node) == b'{"addr": "host", "pid": 42, "local_id": 0}'
    assert decode_alive(b'{"addr": "host", "pid": 42, "local_id": 0, "port": 7}') == (node, 7)


def test_this_process_makes_a_new_node_per_handler_at_its_published_address() -> None:
    first = local_node(RendezvousParameters("etcd-v3", "h:1", "run", 1, 4, local_addr="10.0.0.7"))
    second = local_node(RendezvousParameters("etcd-v3", "h:1", "run", 1, 4))
    assert (first.addr, first.pid) == ("10.0.0.7", os.getpid())
    assert (second.addr, second.pid, second.local_id) == (socket.getfqdn(), os.getpid(), first.local_id + 1)


def test_settings_take_the_shipped_defaults_and_name_a_bad_key() -> None:
    params = RendezvousParameters("etcd-v3", "localhost:2379", "run", 1, 4, last_call_timeout="2")
    loaded = RendezvousSettings.from_params(params)
    assert (loaded.last_call_timeout, loaded.keep_alive_interval, loaded.lease_ttl) == (2, 1, 5)
    with pytest.raises(ValueError, match="--rdzv_conf keep_alive_interval: got 'soon'"):
        RendezvousSettings.from_params(RendezvousParameters("etcd-v3", "h:1", "run", 1, 4, keep_alive_interval="soon"))


def test_the_algorithm_key_is_taken_out_of_the_config_and_checked() -> None:
    params = RendezvousParameters("etcd-v3", "h:1", "run", 1, 4, algorithm="keyed")
    take_algorithm(params)
    assert "algorithm" not in params.config
    take_algorithm(RendezvousParameters("etcd-v3", "h:1", "run", 1, 4))  # the default
    with pytest.raises(ValueError, match=r"^--rdzv_conf algorithm: got 'x'; expected keyed \(the only one, and the "
                                         r"default: leave the key out\)$"):
        take_algorithm(RendezvousParameters("etcd-v3", "h:1", "run", 1, 4, algorithm="x"))


def test_the_removed_dynamic_algorithm_is_refused_in_one_line_naming_what_to_use() -> None:
    with pytest.raises(ValueError) as raised:
        take_algorithm(RendezvousParameters("etcd-v3", "h:1", "run", 1, 4, algorithm="dynamic"))
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("--rdzv_conf algorithm: got 'dynamic', which was removed in this version of elastic_ddp; "
                              "expected keyed (the default: leave the key out)")
    assert "torch's own --rdzv_backend=c10d" in message


@pytest.mark.parametrize("decode", [decode_arrival, decode_alive, decode_heartbeat, decode_record])
def test_a_value_nested_too_deep_is_refused_not_raised(decode) -> None:
    """findings.md 20: json.loads raises RecursionError on deep nesting, which is not a ValueError."""
    assert decode(b"[" * 1024) is None
    assert decode(b'{"addr": ' + b"[" * 1000 + b"]" * 1000 + b"}") is None
