"""The published heartbeat's encoding (elastic_ddp/agent/rendezvous/heartbeats.py): what one node writes
another reads back exactly, and anything else under the heartbeat prefix is refused, not trusted."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from elastic_ddp.agent.rendezvous.heartbeats import MAX_ADDR_CHARS, MAX_BEAT_BYTES, decode_beat, encode_beat, node_key
from elastic_ddp.agent.rendezvous.torch_internals import NodeDesc


def test_a_published_beat_reads_back_as_the_same_node_and_time():
    node = NodeDesc("trainer-7.example.org", 4242, 3)
    beat = datetime(2026, 11, 25, 15, 4, 5, 123456, tzinfo=timezone.utc)
    assert decode_beat(encode_beat(node, beat)) == (node, beat)
    assert node_key(node) == "trainer-7.example.org_4242_3"


@pytest.mark.parametrize("value", [
    b"", b"\xff\xfe", b"not json", b"[1, 2, 3]", b'"text"', b"{}",
    b'{"addr": "x", "pid": 1, "local_id": 0}',
    b'{"addr": "", "pid": 1, "local_id": 0, "beat": 1.0}',
    b'{"addr": 7, "pid": 1, "local_id": 0, "beat": 1.0}',
    b'{"addr": "x", "pid": true, "local_id": 0, "beat": 1.0}',
    b'{"addr": "x", "pid": -1, "local_id": 0, "beat": 1.0}',
    b'{"addr": "x", "pid": 1.5, "local_id": 0, "beat": 1.0}',
    b'{"addr": "x", "pid": 1, "local_id": 0, "beat": "now"}',
    b'{"addr": "x", "pid": 1, "local_id": 0, "beat": NaN}',
    b'{"addr": "x", "pid": 1, "local_id": 0, "beat": Infinity}',
    b'{"addr": "x", "pid": 1, "local_id": 0, "beat": 1e300}',
    b'{"addr": "x", "pid": 1, "local_id": 0, "beat": false}',
    b'{"addr": "x", "pid": 99999999999999999999999, "local_id": 0, "beat": 1.0}',
    ('{"addr": "' + "a" * (MAX_ADDR_CHARS + 1) + '", "pid": 1, "local_id": 0, "beat": 1.0}').encode(),
    b" " * MAX_BEAT_BYTES + b'{"addr": "x", "pid": 1, "local_id": 0, "beat": 1.0}',
], ids=lambda value: repr(value[:40]))
def test_a_value_that_is_not_a_published_beat_is_refused(value):
    assert decode_beat(value) is None


def test_a_value_of_another_type_is_refused():
    assert decode_beat("{}") is None  # type: ignore[arg-type]
