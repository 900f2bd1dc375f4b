"""The rendezvous state of torch's dynamic rendezvous, and its nodes' heartbeats, kept in etcd
through the v3 API.

The state of run `R` is one key, `<key_prefix>/R/state`, holding the base64 of the state bytes
(readable with etcdctl, and a way to tell a corrupt value from a valid one). Its fencing token is
the key's mod_revision: `set_state` writes in one etcd transaction that first compares the
mod_revision with the token, so of two agents writing on the same token exactly one wins. The
key is attached to the writing process's lease (see `EtcdConnection`), so the state of a run that
every agent abandoned disappears `ttl` seconds later.

Each node's heartbeat is a key of its own, `<key_prefix>/R/heartbeats/<node>`, written with a plain
put and read back with range reads of at most `HEARTBEAT_PAGE_KEYS` keys each, every key of the
prefix (`EtcdV3Heartbeats`, see `heartbeats`); it is attached to the writer's lease too, so the
keys of exited agents go away with it.
"""

from __future__ import annotations

import binascii
from base64 import b64decode, b64encode
from datetime import datetime

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic_ddp.agent.rendezvous.etcd_client import Etcd3Client, etcdrpc
from elastic_ddp.agent.rendezvous.etcd_connection import EtcdConnection
from elastic_ddp.agent.rendezvous.heartbeats import decode_beat, encode_beat, node_key
from elastic_ddp.agent.rendezvous.torch_internals import NodeDesc

# The most heartbeat keys one range request asks for. The keys of exited agents stay until their
# lease expires (`ttl`), so a long run with many restarts holds more keys than nodes, and one
# answer for all of them can pass gRPC's 4 MiB limit on a received message (7500 keys of nodes
# with 250-character host names did: the read failed as "no etcd endpoint answered"). A page of
# ours is at most about 1.4 MB (a value is at most MAX_BEAT_BYTES, a key about 300 bytes).
HEARTBEAT_PAGE_KEYS = 1024


def run_key(key_prefix: str, run_id: str) -> str:
    """The etcd key under which everything of run `run_id` lives (no trailing slash)."""
    if not run_id:
        raise ValueError("The run id must be a non-empty string.")
    return f"{key_prefix}/{run_id}"


class EtcdV3RendezvousBackend(RendezvousBackend):
    """A `RendezvousBackend` on etcd v3.

    Honours the base class contract: `get_state` returns None when there is no state;
    `set_state` with no token writes only if there is no state, with a token only if it is the
    current one, and otherwise returns the current state, its token and False (None if the state
    vanished meanwhile). A token that is not one of ours (not an int) never matches. Both raise
    RendezvousStateError when the stored value is not valid base64, and RendezvousConnectionError
    when etcd stays unreachable for the connection's retry budget.

    A write whose answer was lost and that is then retried finds the state it wrote; that counts
    as success, as in torch's C10d backend, since the stored state is exactly the one requested.
    """

    def __init__(self, connection: EtcdConnection, run_id: str) -> None:
        self._connection = connection
        self._key = run_key(connection.options.key_prefix, run_id) + "/state"

    @property
    def key(self) -> str:
        """The etcd key that holds the state."""
        return self._key

    @property
    def name(self) -> str:
        """See base class."""
        return "etcd-v3"

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        value, metadata = self._connection.call("read the rendezvous state",
                                                lambda client: client.get(self._key))
        if value is None:
            return None
        return self._decode(value), metadata.mod_revision

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        if token is None:
            expected_revision = 0  # etcd reports mod_revision 0 for a key that does not exist
        elif isinstance(token, int) and not isinstance(token, bool) and token > 0:
            expected_revision = token
        else:
            current = self.get_state()
            return None if current is None else (*current, False)
        encoded = b64encode(state)

        def write(client: Etcd3Client) -> tuple[bool, list]:
            return client.transaction(
                compare=[client.transactions.mod(self._key) == expected_revision],
                success=[client.transactions.put(self._key, encoded, lease=self._connection.lease_id(client))],
                failure=[client.transactions.get(self._key)],
            )

        succeeded, responses = self._connection.call("write the rendezvous state", write)
        if succeeded:
            return state, responses[0].response_put.header.revision, True
        if not responses[0]:
            return None
        value, metadata = responses[0][0]
        return self._decode(value), metadata.mod_revision, value == encoded

    @staticmethod
    def _decode(value: bytes) -> bytes:
        try:
            return b64decode(value, validate=True)
        except binascii.Error as exc:
            raise RendezvousStateError("The state object is corrupt. See inner exception for details.") from exc


class EtcdV3Heartbeats:
    """The `HeartbeatChannel` of run `run_id` in etcd (see the module docstring).

    `read` reads every key under the prefix, `page_keys` keys per request, and skips values that
    do not decode. Both raise what `EtcdConnection.call` raises when etcd cannot be reached.

    Not guaranteed: one revision for all pages. Keys are read in key order, so a key that exists
    throughout the read is read once; one written or deleted meanwhile may be read or not, as with
    a read a moment earlier or later. A page of values much larger than ours (someone else's keys
    under the prefix) can still pass gRPC's message limit.
    """

    def __init__(self, connection: EtcdConnection, run_id: str, page_keys: int = HEARTBEAT_PAGE_KEYS) -> None:
        if page_keys < 1:
            raise ValueError(f"page_keys: got {page_keys}; expected at least 1")
        self._connection = connection
        self._prefix = run_key(connection.options.key_prefix, run_id) + "/heartbeats/"
        self._page_keys = page_keys

    @property
    def prefix(self) -> str:
        """The etcd key prefix of the heartbeat keys."""
        return self._prefix

    def publish(self, node: NodeDesc, beat: datetime) -> None:
        """See `heartbeats.HeartbeatChannel`."""
        key, value = self._prefix + node_key(node), encode_beat(node, beat)
        self._connection.call("publish a heartbeat",
                              lambda client: client.put(key, value, lease=self._connection.lease_id(client)))

    def read(self) -> dict[NodeDesc, datetime]:
        """See `heartbeats.HeartbeatChannel`."""
        values = self._connection.call("read the heartbeats", self._read_values)
        beats: dict[NodeDesc, datetime] = {}
        for value in values:
            decoded = decode_beat(value)
            if decoded is not None:
                node, beat = decoded
                beats[node] = max(beat, beats.get(node, beat))
        return beats

    def _read_values(self, client: Etcd3Client) -> list[bytes]:
        # etcd3 0.12's get_prefix drops its `limit` (the request goes out without one), so the
        # pages are requested here. etcd answers a range in key order and says whether there is
        # `more`; the next page starts just past the last key of this one.
        start, end = self._prefix.encode(), _prefix_end(self._prefix.encode())
        values: list[bytes] = []
        while True:
            request = etcdrpc.RangeRequest(key=start, range_end=end, limit=self._page_keys)
            answer = client.kvstub.Range(request, client.timeout, credentials=client.call_credentials,
                                         metadata=client.metadata)
            values.extend(kv.value for kv in answer.kvs)
            if not answer.more:
                return values
            if not answer.kvs:
                raise RendezvousConnectionError(f"etcd answered a read of {self._prefix} with 'more' and no keys")
            start = answer.kvs[-1].key + b"\0"


def _prefix_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with `prefix` (etcd's range_end for a prefix)."""
    return prefix[:-1] + bytes([prefix[-1] + 1])  # our prefixes end with "/", never with 0xff
