"""The FIFO queues of `EtcdV3Store` (`queue_push`, `queue_pop`, `queue_len`), one etcd key per item.

Items live under `<queue prefix><url-quoted queue name>/`, ordered by their etcd create revision.
A pop deletes the oldest item in a transaction that also records an operation id under the
store's marks, so a pop whose answer was lost after its commit (a leader dying) is not applied
twice: the retry that loses the race reads its own mark (see etcd_store.py, "Limits").
"""

from __future__ import annotations

import uuid
from urllib.parse import quote

from elastic_ddp.agent.rendezvous.etcd_client import Etcd3Client
from elastic_ddp.agent.rendezvous.etcd_connection import EtcdConnection


def mark_is(connection: EtcdConnection, mark: str, operation: bytes) -> bool:
    """Whether the write that recorded `operation` under `mark` landed."""
    landed, _ = connection.call("read an operation mark", lambda client: client.get(mark))
    return landed == operation


class EtcdStoreQueues:
    """The queues of one store instance: items under `prefix`, pop marks under `marks`."""

    def __init__(self, connection: EtcdConnection, prefix: str, marks: str):
        self._connection = connection
        self.prefix = prefix
        self._marks = marks

    def directory(self, key: str) -> str:
        """The etcd prefix of queue `key`'s items."""
        # Quoted, '/' included, so that queue "a" never lists the items of queue "a/b".
        return self.prefix + quote(key, safe="") + "/"

    def push(self, key: str, data: bytes) -> None:
        item = self.directory(key) + uuid.uuid4().hex  # chosen once: a retried put is the same item
        self._connection.call(f"push to store queue {key!r}", lambda client: client.put(
            item, data, lease=self._connection.lease_id(client)))

    def length(self, key: str) -> int:
        response = self._connection.call(f"count store queue {key!r}", lambda client: client.get_prefix_response(
            self.directory(key), keys_only=True, count_only=True))
        return response.count

    def pop_oldest(self, key: str) -> bytes | None:
        """Remove and return the oldest item of queue `key`, or None if it is empty now."""
        operation = uuid.uuid4().hex.encode()
        mark = self._marks + quote(key, safe="")
        while True:
            oldest = self._oldest_item(key)
            if oldest is None:
                return None
            value, item, created = oldest
            if self._take_item(item, created, mark, operation) or mark_is(self._connection, mark, operation):
                return value
            # Another consumer took it first: try the next one.

    def _oldest_item(self, key: str) -> tuple[bytes, bytes, int] | None:
        """(value, etcd key, create revision) of the oldest item of queue `key`, or None."""
        items = self._connection.call(f"read store queue {key!r}", lambda client: list(client.get_prefix(
            self.directory(key), sort_order="ascend", sort_target="create", limit=1)))
        if not items:
            return None
        value, metadata = items[0]
        return value, metadata.key, metadata.create_revision

    def _take_item(self, item: bytes, created: int, mark: str, operation: bytes) -> bool:
        """Delete queue item `item` if it is still the one created at revision `created`."""
        def take(client: Etcd3Client) -> bool:
            succeeded, _ = client.transaction(
                compare=[client.transactions.create(item) == created],
                success=[client.transactions.delete(item),
                         client.transactions.put(mark, operation, lease=self._connection.lease_id(client))],
                failure=[])
            return succeeded

        return self._connection.call("take a store queue item", take)
