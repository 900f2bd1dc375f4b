"""A `torch.distributed.Store` on etcd v3, for the torchrun agents of one run.

torchrun's agents use the rendezvous store to publish MASTER_ADDR/MASTER_PORT for the workers,
to assign worker ranks and for their exit barrier: `set`, `get`, `add`, `compare_set`, `wait`,
`check`, `multi_get`, `multi_set`, `delete_key`, `num_keys` (and `append`, which torch builds on
`compare_set`). Keys live under `<key_prefix>/<run_id>/store/`, so runs never see each other's
keys, and are attached to the writing process's lease (see `EtcdConnection`).

Contract and limits:
- Values are bytes; a str is stored as its UTF-8. `add` keeps a decimal integer, like c10d.
- `add` and `compare_set` are atomic across processes: read, then a transaction that writes only
  if the key's mod_revision is unchanged, repeated until it wins. An `add` whose answer was lost
  in a failover is not applied twice (see `add`).
- `get`, `wait` and `multi_get` block until every key exists, polling with back-off (10 ms growing
  to 250 ms) rather than watching: a watch stream of etcd3 0.12 does not survive a failover. They
  raise `DistStoreError` after the store timeout (`set_timeout`, default 300 s), as c10d stores do.
- An etcd outage inside one call is retried for the connection's `retry_timeout`, then raised as
  RendezvousConnectionError. An `add` whose answer was lost mid-commit may be applied twice.
- The training workers do not use this store: they get MASTER_ADDR/MASTER_PORT and build their own.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

from torch.distributed import DistStoreError, Store

from elastic_ddp.rendezvous.etcd_backend import run_key
from elastic_ddp.rendezvous.etcd_client import Etcd3Client
from elastic_ddp.rendezvous.etcd_connection import EtcdConnection

_FIRST_POLL_S = 0.01
_MAX_POLL_S = 0.25


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdV3Store(Store):
    """A c10d store whose keys live in etcd under `<key_prefix>/<run_id>/store/`."""

    def __init__(self, connection: EtcdConnection, run_id: str, timeout: timedelta | None = None) -> None:
        super().__init__()  # the pybind trampoline needs it
        self._connection = connection
        self._prefix = run_key(connection.options.key_prefix, run_id) + "/store/"
        # Where `add` marks which of its writes landed; outside the store's keys (num_keys).
        self._add_marks = f"{run_key(connection.options.key_prefix, run_id)}/store-add-marks/{uuid.uuid4().hex}/"
        if timeout is not None:
            self.set_timeout(timeout)

    @property
    def prefix(self) -> str:
        """The etcd key prefix of this store's keys (ends with '/')."""
        return self._prefix

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: str | bytes) -> None:
        """See base class."""
        data = _as_bytes(value)
        self._connection.call(f"set store key {key!r}", lambda client: client.put(
            self._key(key), data, lease=self._connection.lease_id(client)))

    def get(self, key: str) -> bytes:
        """See base class. Waits for the key up to the store timeout."""
        return self._wait_for_values([key], self.timeout)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """See base class. Waits for every key up to the store timeout."""
        return self._wait_for_values(list(keys), self.timeout)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """See base class. All keys are written in one transaction."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")

        def write(client: Etcd3Client) -> None:
            lease = self._connection.lease_id(client)
            puts = [client.transactions.put(self._key(k), _as_bytes(v), lease=lease)
                    for k, v in zip(keys, values, strict=True)]
            client.transaction(compare=[], success=puts, failure=[])

        self._connection.call(f"set {len(keys)} store keys", write)

    def add(self, key: str, amount: int) -> int:
        """See base class. Atomic across processes; a missing key counts as 0; applied once.

        A write whose answer is lost (an etcd leader dying after the commit) is retried by the
        connection and then fails its revision check; so each write also records an operation id
        of this store under `_add_marks`, in the same transaction, and a failed attempt whose id is
        there had landed: it is not added again.
        """
        operation = uuid.uuid4().hex.encode()
        mark = self._add_marks + key
        while True:
            value, revision = self._read(key)
            total = int(value or b"0") + amount
            if self._write_if_unchanged(key, revision, str(total).encode(), also=(mark, operation)):
                return total
            landed, _ = self._connection.call(f"read add mark of {key!r}", lambda client: client.get(mark))
            if landed == operation:
                return total

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """See base class. Same rules as TCPStore.

        Sets `desired_value` if the key holds `expected_value`, or if it is missing and
        `expected_value` is empty. Returns the value the key holds afterwards; for a missing key
        and a non-empty `expected_value`, returns `expected_value` (as TCPStore does).
        """
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        while True:
            value, revision = self._read(key)
            if value is None and expected:
                return expected
            if value is not None and value != expected:
                return value
            if self._write_if_unchanged(key, revision, desired):
                return desired

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """See base class. Raises DistStoreError if a key is still missing after the timeout."""
        self._wait_for_values(list(keys), self.timeout if timeout is None else timeout)

    def check(self, keys: list[str]) -> bool:
        """See base class. True if every key exists now."""
        return all(value is not None for value in self._read_many(list(keys)))

    def delete_key(self, key: str) -> bool:
        """See base class. True if the key existed."""
        return self._connection.call(f"delete store key {key!r}", lambda client: client.delete(self._key(key)))

    def num_keys(self) -> int:
        """See base class. The number of keys of this run's store."""
        response = self._connection.call("count store keys", lambda client: client.get_prefix_response(
            self._prefix, keys_only=True))
        return response.count

    # torch's C++ PrefixStore calls these two through the pybind trampoline by their C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys

    def _read(self, key: str) -> tuple[bytes | None, int]:
        value, metadata = self._connection.call(f"read store key {key!r}", lambda client: client.get(self._key(key)))
        return value, 0 if metadata is None else metadata.mod_revision

    def _write_if_unchanged(self, key: str, revision: int, value: bytes,
                            also: tuple[str, bytes] | None = None) -> bool:
        """Put `value` if `key`'s mod_revision is still `revision`; with `also`, put that full key and
        value in the same transaction."""
        full_key = self._key(key)

        def write(client: Etcd3Client) -> bool:
            lease = self._connection.lease_id(client)
            puts = [client.transactions.put(full_key, value, lease=lease)]
            if also is not None:
                puts.append(client.transactions.put(also[0], also[1], lease=lease))
            succeeded, _ = client.transaction(
                compare=[client.transactions.mod(full_key) == revision], success=puts, failure=[])
            return succeeded

        return self._connection.call(f"update store key {key!r}", write)

    def _read_many(self, keys: list[str]) -> list[bytes | None]:
        def read(client: Etcd3Client) -> list[bytes | None]:
            _, responses = client.transaction(
                compare=[], success=[client.transactions.get(self._key(k)) for k in keys], failure=[])
            return [kvs[0][0] if kvs else None for kvs in responses]

        return self._connection.call(f"read {len(keys)} store keys", read)

    def _wait_for_values(self, keys: list[str], timeout: timedelta) -> list[bytes]:
        deadline = time.monotonic() + timeout.total_seconds()
        pause = _FIRST_POLL_S
        while True:
            values = self._read_many(keys)
            if all(value is not None for value in values):
                return values
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [k for k, v in zip(keys, values, strict=True) if v is None]
                raise DistStoreError(f"Timed out after {timeout.total_seconds():g} s waiting for store "
                                     f"keys {missing} under {self._prefix} in etcd")
            time.sleep(min(pause, left))
            pause = min(pause * 2, _MAX_POLL_S)
