"""A `torch.distributed.Store` on etcd v3, for the torchrun agents of one run.

torchrun's agents use the rendezvous store to publish MASTER_ADDR/MASTER_PORT for the workers,
to assign worker ranks and for their exit barrier. `EtcdV3Store` implements the whole store API of
torch 2.13, so it also works under torch's C++ `PrefixStore` and `Store.barrier`, and passes the
generic store checks of torch's own `test/distributed/test_store.py` (its queue checks only when
called directly: see Limits). Keys live under
`<key_prefix>/<run_id>/store/`, so runs never see each other's keys, and are attached to the
writing process's lease (see `EtcdConnection`).

Contract:
- `set`, `get`, `check`, `delete_key`, `num_keys`, `multi_get`, `multi_set` (one transaction),
  `list_keys`. Values are bytes, NUL included; a str is stored as its UTF-8.
- `add` keeps a decimal integer and returns the new value as an int, like c10d; a missing key
  counts as 0. `append` adds bytes at the end, creating a missing key. `compare_set` follows
  TCPStore's rules. All three are atomic across processes: read, then a transaction that writes
  only if the key's mod_revision is unchanged, repeated until it wins.
- `has_extended_api()` is True: `append`, `multi_get` and `multi_set` are native, and torch's C++
  `PrefixStore` forwards them here instead of emulating them key by key.
- `clone()` returns another store on the same connection, run and timeout: it sees the same keys
  and may be used from another thread (the connection is thread-safe).
- `get`, `wait` and `multi_get` block until every key exists; `wait(keys, timeout)` takes its own
  timeout, the others the store's (`set_timeout`/`timeout`, default 300 s). They raise
  `DistStoreError` with one line naming the operation, "timeout", the missing keys and the etcd
  prefix. A zero timeout waits forever, as c10d's `kNoTimeout` does in HashStore and FileStore.
- Queues: `queue_push`, `queue_pop(key, block=True)`, `queue_len`, first in first out across
  processes (by etcd create revision). A blocking pop waits up to the store timeout
  (`DistStoreError`); a non-blocking pop of an empty queue raises `QueueEmptyError`. `check` and
  `wait` count a non-empty queue as an existing key, as TCPStore does; `num_keys`, `list_keys`,
  `get` and `delete_key` see only plain keys. Queue items live under
  `<key_prefix>/<run_id>/store-queues/<url-quoted key>/`.

Limits:
- Waiting polls with back-off (10 ms growing to `max_poll_s`, 250 ms) rather than watching: a watch
  stream of etcd3 0.12 does not survive a failover. A key set is seen up to `max_poll_s` late.
- An etcd outage inside one call is retried for the connection's `retry_timeout`, then raised as
  RendezvousConnectionError. An `add`, `append` or `queue_pop` whose answer was lost after its
  commit is not applied twice: each also writes an operation id of this store instance to a mark
  under `<key_prefix>/<run_id>/store-marks/<store id>/`, and a retry that loses its revision check
  reads the mark. This is exact for one thread per store instance; threads sharing one instance
  and racing on the same key during a failover may still double-apply (use `clone()` per thread).
- Through torch's C++ code (`PrefixStore`, process groups) only what the pybind trampoline of
  torch 2.13 forwards reaches Python: not `queue_push`/`queue_pop`/`queue_len` nor `list_keys`,
  which raise NotImplementedError there. Call them on the `EtcdV3Store` itself.
- pybind11 keeps only the C++ half of a Python store that C++ alone references; every call then
  fails with "Not implemented". So keep a Python reference to the store while C++ (a PrefixStore)
  uses it, as torchrun's handler does. A clone made by C++ (`PrefixStore.clone()`) has no such
  reference, so each clone is kept in its parent's list and lives as long as the parent: each
  `clone()` costs a small object (no connection) until the parent goes.
- The training workers do not use this store: they get MASTER_ADDR/MASTER_PORT and build their own.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar
from urllib.parse import quote

from torch.distributed import DistStoreError, QueueEmptyError, Store

from elastic_ddp.agent.rendezvous.etcd.client import Etcd3Client
from elastic_ddp.agent.rendezvous.etcd.connection import EtcdConnection
from elastic_ddp.agent.rendezvous.etcd.options import run_key

T = TypeVar("T")

_FIRST_POLL_S = 0.01
_MAX_POLL_S = 0.25


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _range_end(prefix: str) -> bytes:
    """The end of etcd's key range of everything under `prefix` (its last byte plus one)."""
    raw = prefix.encode()
    return raw[:-1] + bytes([raw[-1] + 1])


def _mark_is(connection: EtcdConnection, mark: str, operation: bytes) -> bool:
    """Whether the write that recorded `operation` under `mark` landed."""
    landed, _ = connection.call("read an operation mark", lambda client: client.get(mark))
    return landed == operation


class _Queues:
    """The FIFO queues of one store instance, one etcd key per item: items under `prefix`, ordered
    by their create revision; pop marks under `marks`.

    A pop deletes the oldest item in a transaction that also records an operation id under the
    marks, so a pop whose answer was lost after its commit is not applied twice (module docstring,
    "Limits").
    """

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
            if self._take_item(item, created, mark, operation) or _mark_is(self._connection, mark, operation):
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


class EtcdV3Store(Store):
    """A c10d store whose keys live in etcd under `<key_prefix>/<run_id>/store/`.

    See the module docstring for the contract and its limits. Thread-safe.
    """

    # The longest pause between two looks of a wait (the first is 10 ms, then doubling).
    max_poll_s: float = _MAX_POLL_S

    def __init__(self, connection: EtcdConnection, run_id: str, timeout: timedelta | None = None) -> None:
        super().__init__()  # the pybind trampoline needs it
        run = run_key(connection.options.key_prefix, run_id)
        self._connection = connection
        self._run_id = run_id
        self._prefix = run + "/store/"
        # Where `add`, `append` and `queue_pop` mark which of their writes landed; outside the
        # store's keys, so `num_keys` does not count them. One id per instance: see `_update`.
        self._marks = f"{run}/store-marks/{uuid.uuid4().hex}/"
        self._queues = _Queues(connection, run + "/store-queues/", self._marks + "queues/")
        self._clones: list[EtcdV3Store] = []
        if timeout is not None:
            self.set_timeout(timeout)

    @property
    def prefix(self) -> str:
        """The etcd key prefix of this store's keys (ends with '/')."""
        return self._prefix

    def clone(self) -> EtcdV3Store:
        """See base class. Same connection, run and timeout; the clone sees the same keys.

        The clone is also kept in this store's `_clones`: when C++ calls `clone()` (torch's
        `PrefixStore.clone()`), only C++ references the result, and pybind11 would drop its Python
        half at once, leaving a store whose every call fails with "Not implemented".
        """
        twin = EtcdV3Store(self._connection, self._run_id, self.timeout)
        twin.max_poll_s = self.max_poll_s
        self._clones.append(twin)
        return twin

    def has_extended_api(self) -> bool:
        """See base class. True: `append`, `multi_get` and `multi_set` are native.

        torch 2.13's trampoline (`PythonStore::hasExtendedApi`) looks this method up on the Python
        class, so C++ callers such as `PrefixStore` see True too.
        """
        return True

    # --- plain keys ---------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        """See base class."""
        data = _as_bytes(value)
        self._connection.call(f"set store key {key!r}", lambda client: client.put(
            self._key(key), data, lease=self._connection.lease_id(client)))

    def get(self, key: str) -> bytes:
        """See base class. Waits for the key up to the store timeout."""
        return self._wait_for_values("get", [key], self.timeout)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """See base class. Waits for every key up to the store timeout; values in `keys` order."""
        return self._wait_for_values("multi_get", list(keys), self.timeout)

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
        """See base class. Atomic across processes; a missing key counts as 0; applied once."""
        total = self._update(key, lambda value: str(int(value or b"0") + amount).encode())
        return int(total)

    def append(self, key: str, value: str | bytes) -> None:
        """See base class. Atomic across processes; a missing key is created; applied once."""
        suffix = _as_bytes(value)
        self._update(key, lambda current: (current or b"") + suffix)

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
        """See base class. Raises DistStoreError if a key is still missing after the timeout.

        A non-empty queue counts as an existing key.
        """
        keys = list(keys)
        missing = keys

        def all_present() -> bool | None:
            nonlocal missing
            missing = [k for k, present in zip(keys, self._presence(keys), strict=True) if not present]
            return None if missing else True

        self._poll("wait", self.timeout if timeout is None else timeout, all_present,
                   lambda: f"keys {missing} under {self._prefix}")

    def check(self, keys: list[str]) -> bool:
        """See base class. True if every key (or a non-empty queue of that name) exists now."""
        return all(self._presence(list(keys)))

    def delete_key(self, key: str) -> bool:
        """See base class. True if the key existed."""
        return self._connection.call(f"delete store key {key!r}", lambda client: client.delete(self._key(key)))

    def num_keys(self) -> int:
        """See base class. The number of plain keys of this run's store (not queues, not marks)."""
        response = self._connection.call("count store keys", lambda client: client.get_prefix_response(
            self._prefix, keys_only=True, count_only=True))
        return response.count

    def list_keys(self) -> list[str]:
        """See base class. The plain keys of this run's store, sorted. Not reachable from C++."""
        response = self._connection.call("list store keys", lambda client: client.get_prefix_response(
            self._prefix, keys_only=True, sort_order="ascend"))
        return [kv.key.decode()[len(self._prefix):] for kv in response.kvs]

    # torch's C++ PrefixStore calls these two through the pybind trampoline by their C++ names.
    deleteKey = delete_key
    getNumKeys = num_keys

    # --- queues -------------------------------------------------------------------------------

    def queue_push(self, key: str, value: str | bytes) -> None:
        """See base class. Appends to queue `key`; not reachable through C++ (see module docstring)."""
        self._queues.push(key, _as_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """See base class. Takes the oldest item of queue `key`; each item goes to one caller.

        Blocking, waits up to the store timeout (DistStoreError); non-blocking, raises
        QueueEmptyError at once if the queue is empty.
        """
        if not block:
            value = self._queues.pop_oldest(key)
            if value is None:
                raise QueueEmptyError(f"queue {key!r} under {self._queues.prefix} in etcd is empty")
            return value
        return self._poll("queue_pop", self.timeout, lambda: self._queues.pop_oldest(key),
                          lambda: f"an item of queue {key!r} under {self._queues.prefix}")

    def queue_len(self, key: str) -> int:
        """See base class. The number of items in queue `key` now."""
        return self._queues.length(key)

    # --- helpers ------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _read(self, key: str) -> tuple[bytes | None, int]:
        value, metadata = self._connection.call(f"read store key {key!r}", lambda client: client.get(self._key(key)))
        return value, 0 if metadata is None else metadata.mod_revision

    def _update(self, key: str, change: Callable[[bytes | None], bytes]) -> bytes:
        """Replace `key`'s value (None if missing) by `change(value)` atomically; return the new value.

        A write whose answer is lost (an etcd leader dying after the commit) is retried by the
        connection and then fails its revision check; so each write also records an operation id
        under `_marks`, in the same transaction, and a failed attempt whose id is there had landed:
        it is not applied again.
        """
        operation = uuid.uuid4().hex.encode()
        mark = self._marks + "keys/" + key
        while True:
            value, revision = self._read(key)
            new = change(value)
            if self._write_if_unchanged(key, revision, new, also=(mark, operation)):
                return new
            if _mark_is(self._connection, mark, operation):
                return new

    def _write_if_unchanged(self, key: str, revision: int, value: bytes,
                            also: tuple[str, bytes] | None = None) -> bool:
        """Put `value` if `key`'s mod_revision is still `revision` (0: missing); with `also`, put
        that full key and value in the same transaction."""
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

    def _presence(self, keys: list[str]) -> list[bool]:
        """For each key: does it exist, or does a queue of that name hold an item? One transaction."""
        def read(client: Etcd3Client) -> list[bool]:
            reads = []
            for k in keys:
                queue = self._queues.directory(k)
                reads += [client.transactions.get(self._key(k)),
                          client.transactions.get(queue, range_end=_range_end(queue))]
            _, responses = client.transaction(compare=[], success=reads, failure=[])
            return [bool(plain) or bool(queued) for plain, queued in zip(responses[::2], responses[1::2], strict=True)]

        return self._connection.call(f"check {len(keys)} store keys", read)

    def _wait_for_values(self, operation: str, keys: list[str], timeout: timedelta) -> list[bytes]:
        missing = keys

        def values_if_all_set() -> list[bytes] | None:
            nonlocal missing
            values = self._read_many(keys)
            missing = [k for k, v in zip(keys, values, strict=True) if v is None]
            return None if missing else values

        return self._poll(operation, timeout, values_if_all_set, lambda: f"keys {missing} under {self._prefix}")

    def _poll(self, operation: str, timeout: timedelta, attempt: Callable[[], T | None],
              awaited: Callable[[], str]) -> T:
        """Call `attempt` until it returns something other than None, with back-off.

        After `timeout` (a zero timeout: never) raise DistStoreError, one line naming
        `operation`, "timeout" and what was `awaited()` (which names the keys and their prefix).
        """
        seconds = timeout.total_seconds()
        deadline = None if seconds == 0 else time.monotonic() + seconds
        pause = _FIRST_POLL_S
        while True:
            result = attempt()
            if result is not None:
                return result
            left = self.max_poll_s if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise DistStoreError(f"{operation} timeout after {seconds:g} s waiting for {awaited()} in etcd")
            time.sleep(min(pause, left))
            pause = min(pause * 2, self.max_poll_s)
