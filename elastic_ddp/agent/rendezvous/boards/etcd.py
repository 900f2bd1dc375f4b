"""The rendezvous's board in etcd v3 (`EtcdRoundBoard`), and `create_etcd_v3_handler`,
what `--rdzv_backend=etcd-v3` builds.

Keys of run `R`, under `<key_prefix>/R/rdzv/`:

    record                    the last closed round (`state.RoundRecord`, JSON), on the closer's run lease
    closed                    present once `set_closed` was called
    arrivals/<round>/<node>   a node's arrival at a round (`state.encode_arrival`), on its node lease
    alive/<node>              the node's liveness and beacon port (`probes`), on its node lease

Each handler holds a *node lease* of `keep_alive_interval x keep_alive_max_attempt` seconds
(`RendezvousSettings.lease_ttl`), refreshed by a thread every `keep_alive_interval` over the connection's
one keep-alive stream (`EtcdConnection.keep_alive`), without the board's lock: when the agent dies
the lease expires and etcd deletes its arrival and liveness keys; `leave` revokes it at once. If a
refresh finds the lease expired (etcd unreachable, or the process starved of CPU, for longer than
its TTL), the thread takes a new one and writes the node's liveness and last arrival again; so does an
arrival that finds it gone (a write retried on the dead lease would fail for the whole retry budget).

`view` is one transaction of three range reads (record, closed flag, count and earliest of the
round's arrivals, by create revision), each of constant size: the record's value (O(N) bytes) comes
only when its mod revision changed since this board read it; `close_round` is one transaction that compares the record's
mod revision with the one read. Every operation goes through `EtcdConnection.call` (retries,
failover, TLS, auth). `counts` counts this board's requests by kind, for the benchmarks: `reads`,
`writes` (lease, liveness, arrivals, set_closed, revoke), `closes` (of which `lost_closes` lost their
comparison) and `refreshes` (of the node lease).

Not guaranteed: the arrivals of one round are read in one answer, so gRPC's 4 MiB message limit
bounds a round to about 4000 nodes.
"""

from __future__ import annotations

import collections
import logging
import threading

import grpc
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
    RendezvousStateError,
)

from elastic_ddp.agent.rendezvous.agent_setup import local_node, prepare_agent, warn_if_loopback_published
from elastic_ddp.agent.rendezvous.defaults import SYNC_POLL_S
from elastic_ddp.agent.rendezvous.etcd.client import Etcd3Client, etcdrpc
from elastic_ddp.agent.rendezvous.etcd.connection import EtcdConnection, is_lease_not_found
from elastic_ddp.agent.rendezvous.etcd.options import ETCD_KEYS, EtcdV3Options, run_key
from elastic_ddp.agent.rendezvous.etcd.store import EtcdV3Store
from elastic_ddp.agent.rendezvous.handler import BoardView, RoundRendezvousHandler
from elastic_ddp.agent.rendezvous.probes import ExitWitness
from elastic_ddp.agent.rendezvous.rounds import RendezvousSettings
from elastic_ddp.agent.rendezvous.state import (
    NodeDesc,
    RoundRecord,
    decode_alive,
    decode_arrival,
    decode_record,
    encode_alive,
    encode_arrival,
    node_name,
)

logger = logging.getLogger(__name__)



def _prefix_end(prefix: str) -> bytes:
    raw = prefix.encode()
    return raw[:-1] + bytes([raw[-1] + 1])  # our prefixes end with "/"


def _range(key: str, prefix: bool = False, **fields) -> etcdrpc.RequestOp:
    request = etcdrpc.RangeRequest(key=key.encode(), range_end=_prefix_end(key) if prefix else b"", **fields)
    return etcdrpc.RequestOp(request_range=request)


# A write bound to the node lease tries this many leases before it fails: a lease expires only when
# its refreshes stopped for its whole TTL (etcd unreachable, or this process starved of CPU).
_LEASE_ATTEMPTS = 3


class _NodeLeaseLost(RendezvousConnectionError):
    """etcd no longer has the node lease that a write was bound to (it expired)."""


class EtcdRoundBoard:
    """A `handler.RoundBoard` in etcd (module docstring). Thread-safe."""

    name = "etcd-v3"

    def __init__(self, connection: EtcdConnection, store: EtcdV3Store, run_id: str, settings: RendezvousSettings) -> None:
        self._connection = connection
        self.store = store
        self._base = run_key(connection.options.key_prefix, run_id) + "/rdzv/"
        self._settings = settings
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._node: NodeDesc | None = None
        self._port: int | None = None
        self._arrival_key: str | None = None  # this node's newest arrival
        self._known: tuple[int, RoundRecord] | None = None  # the record last read, and its mod revision
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self.counts: collections.Counter[str] = collections.Counter()

    # --- requests ----------------------------------------------------------------------------

    def _txn(self, what: str, success: list, compare: list | None = None, kind: str = "reads",
             node_lease: bool = False, failure: list | None = None) -> etcdrpc.TxnResponse:
        """`node_lease`: the puts are bound to the node lease, and `_NodeLeaseLost` is raised at once
        if etcd no longer has it (the connection would retry the same dead lease for its whole budget)."""
        self.counts[kind] += 1

        def send(client: Etcd3Client) -> etcdrpc.TxnResponse:
            request = etcdrpc.TxnRequest(compare=compare or [], success=success, failure=failure or [])
            try:
                return client.kvstub.Txn(request, client.timeout, credentials=client.call_credentials,
                                         metadata=client.metadata)
            except grpc.RpcError as exc:
                if node_lease and is_lease_not_found(exc):
                    raise _NodeLeaseLost(f"node {node_name(self._node)}'s lease expired") from exc
                raise

        return self._connection.call(what, send)

    def _put(self, key: str, value: bytes, lease: int) -> etcdrpc.RequestOp:
        return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=key.encode(), value=value, lease=lease))

    def _arrival_prefix(self, round_number: int) -> str:
        return f"{self._base}arrivals/{round_number}/"

    # --- liveness ----------------------------------------------------------------------------

    def start(self, node: NodeDesc, port: int | None) -> None:
        """See `RoundBoard`: take the node lease, write the liveness key, start refreshing."""
        with self._lock:
            if self._keeper is not None:
                return
            self._node, self._port = node, port
            self._new_lease()
            self._keeper = threading.Thread(target=self._keep_alive, name="rdzv-lease", daemon=True)
            self._keeper.start()

    def _new_lease(self) -> None:
        """Take a node lease and (re)write this node's keys on it; hold `_lock`."""
        assert self._node is not None
        self.counts["writes"] += 1
        self._lease = self._connection.call("take a node lease",
                                            lambda client: client.lease(self._settings.lease_ttl).id)
        puts = [self._put(f"{self._base}alive/{node_name(self._node)}", encode_alive(self._node, self._port),
                          self._lease)]
        if self._arrival_key is not None:
            puts.append(self._put(self._arrival_key, encode_arrival(self._node), self._lease))
        self._txn("write this node's liveness", puts, kind="writes", node_lease=True)

    def _keep_alive(self) -> None:
        while not self._stop.wait(self._settings.keep_alive_interval):
            try:
                self._refresh()
            except RendezvousError as exc:  # etcd unreachable beyond the retry budget: try again next tick
                if self._stop.is_set():  # left meanwhile: the lease is revoked or left to expire
                    return
                logger.warning("the rendezvous could not refresh node %s's lease: %s",
                               node_name(self._node) if self._node else "?", exc)

    def _refresh(self) -> None:
        """Refresh the node lease, without `_lock`: a refresh that retries (etcd away, up to its
        retry budget) must not hold up `arrive` or `leave`. Only a lease found expired takes the
        lock, to write this node's keys again on a new one, unless `arrive` did that meanwhile."""
        lease = self._lease
        if lease is None:
            return
        self.counts["refreshes"] += 1

        def refresh(client: Etcd3Client) -> int:
            self._connection.lease_id(client)  # keeps this process's run lease (the record's) alive too
            return self._connection.keep_alive(client, lease)

        if self._connection.call("refresh a node lease", refresh) > 0:
            return
        with self._lock:
            if self._stop.is_set() or self._lease != lease:
                return
            logger.warning("node %s's lease had expired: its keys are written again", node_name(self._node))
            self._new_lease()

    def leave(self) -> None:
        """See `RoundBoard`: stop refreshing and revoke the lease (its keys go at once)."""
        self._stop.set()
        with self._lock:
            lease, self._lease = self._lease, None
            self._arrival_key = None
        if lease is not None:
            self.counts["writes"] += 1
            self._connection.call("revoke a node lease", lambda client: _revoke(client, lease))

    # --- rounds ------------------------------------------------------------------------------

    def arrive(self, round_number: int, node: NodeDesc) -> None:
        """See `RoundBoard`. One transaction: this arrival, and the deletion of the previous one."""
        key = self._arrival_prefix(round_number) + node_name(node)
        with self._lock:
            assert self._lease is not None, "start() first"
            for attempt in range(_LEASE_ATTEMPTS):
                try:
                    if attempt > 0:  # etcd dropped the lease and this node's keys with it: take them again
                        logger.warning("node %s's lease had expired when it arrived at round %d: its keys are "
                                       "written again", node_name(node), round_number)
                        self._new_lease()
                    ops = [self._put(key, encode_arrival(node), self._lease)]
                    if self._arrival_key not in (None, key):
                        ops.append(etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(
                            key=self._arrival_key.encode())))
                    self._txn(f"arrive at round {round_number}", ops, kind="writes", node_lease=True)
                    break
                except _NodeLeaseLost:
                    if attempt == _LEASE_ATTEMPTS - 1:
                        raise
            self._arrival_key = key

    def view(self, round_number: int) -> BoardView:
        """See `RoundBoard`. One transaction of three reads, each of constant size: the record's
        value (about 80 bytes per member) only when its revision is not the one read before."""
        rest = [_range(self._base + "closed", keys_only=True),
                _range(self._arrival_prefix(round_number), prefix=True, limit=1, keys_only=True,
                       sort_order=etcdrpc.RangeRequest.ASCEND, sort_target=etcdrpc.RangeRequest.CREATE)]
        key, known = self._base + "record", self._known
        if known is None:
            answer = self._txn("read the round", [_range(key), *rest])
        else:
            unchanged = etcdrpc.Compare(key=key.encode(), result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.MOD,
                                        mod_revision=known[0])
            answer = self._txn("read the round", [_range(key, keys_only=True), *rest], compare=[unchanged],
                               failure=[_range(key), *rest])
        record_kvs, closed_kvs, arrivals = (op.response_range for op in answer.responses)
        record, token = None, 0
        if known is not None and answer.succeeded:
            token, record = known
        elif record_kvs.kvs:
            record = decode_record(record_kvs.kvs[0].value)
            if record is None:
                raise RendezvousStateError(f"the round record at {key} is not valid (schema: "
                                           "elastic_ddp.agent.rendezvous.state)")
            token = record_kvs.kvs[0].mod_revision
            self._known = (token, record)
        else:
            self._known = None  # no record (any more)
        first = None
        if arrivals.kvs:
            first = arrivals.kvs[0].key.decode()[len(self._arrival_prefix(round_number)):]
        return BoardView(record, token, bool(closed_kvs.kvs), arrivals.count, first)

    def _values(self, what: str, prefix: str) -> list[bytes]:
        """The values under `prefix`, by create revision."""
        answer = self._txn(what, [_range(prefix, prefix=True, sort_order=etcdrpc.RangeRequest.ASCEND,
                                         sort_target=etcdrpc.RangeRequest.CREATE)])
        return [kv.value for kv in answer.responses[0].response_range.kvs]

    def arrivals(self, round_number: int) -> list[NodeDesc]:
        """See `RoundBoard`. Values that do not decode are skipped."""
        values = self._values(f"read the arrivals at round {round_number}", self._arrival_prefix(round_number))
        return [node for node in map(decode_arrival, values) if node is not None]

    def waiting(self, round_number: int) -> list[NodeDesc]:
        """See `RoundBoard`."""
        return self.arrivals(round_number)

    def alive(self) -> dict[NodeDesc, int | None]:
        """See `RoundBoard`. Values that do not decode are skipped."""
        found = [decode_alive(value) for value in self._values("read the live nodes", self._base + "alive/")]
        return dict(entry for entry in found if entry is not None)

    def close_round(self, record: RoundRecord, token: int) -> bool:
        """See `RoundBoard`: write `record` if the record's mod revision is still `token`."""
        key = self._base + "record"
        compare = etcdrpc.Compare(key=key.encode(), result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.MOD,
                                  mod_revision=token)
        lease = self._connection.call("take the run lease", self._connection.lease_id)
        answer = self._txn(f"close round {record.round}", [self._put(key, record.encode(), lease)],
                           compare=[compare], kind="closes")
        self.counts["lost_closes"] += int(not answer.succeeded)
        return bool(answer.succeeded)

    def set_closed(self) -> None:
        """See `RoundBoard`."""
        self.counts["writes"] += 1
        self._connection.call("close the rendezvous", lambda client: client.put(
            self._base + "closed", b"1", lease=self._connection.lease_id(client)))

    def is_closed(self) -> bool:
        """See `RoundBoard`."""
        return self.view(-1).closed


def create_etcd_v3_handler(params: RendezvousParameters) -> RoundRendezvousHandler:
    """The rendezvous on etcd v3 (`handler`).

    Raises ValueError for a bad `--rdzv_endpoint`/`--rdzv_conf` value before connecting, and a
    `RendezvousConnectionError` when etcd cannot be reached (see `etcd.connection`).
    """
    settings = prepare_agent(params, ETCD_KEYS)
    options = EtcdV3Options.from_params(params)
    warn_if_loopback_published(params.local_addr, options.endpoints)
    connection = EtcdConnection(options)
    try:
        store = EtcdV3Store(connection, params.run_id)
        # Members read rank 0's address from it as soon as they see a new round, often before rank 0
        # (at its own next look) wrote it; the store's back-off to 250 ms could make them see it up
        # to 250 ms late (docs/benchmarks-history.md).
        store.max_poll_s = SYNC_POLL_S / 2
        board = EtcdRoundBoard(connection, store, params.run_id, settings)
        board.view(0)  # fails here, not in the first round, if etcd refuses us
    except BaseException:
        connection.close()
        raise
    logger.info("etcd-v3 rendezvous '%s' on %s (%s): last call %g s, node lease %d s, join timeout %g s",
                params.run_id, ", ".join(options.endpoint_names), options.protocol, settings.last_call_timeout,
                settings.lease_ttl, settings.join_timeout)
    return RoundRendezvousHandler(board, local_node(params), settings, ExitWitness(settings.probe_dead_nodes))


def _revoke(client: Etcd3Client, lease: int) -> None:
    """Revoke `lease`; one that etcd no longer has (it expired: the node stopped refreshing it) is
    gone already, which is what revoking asks; retrying it would spend the whole retry budget."""
    try:
        client.revoke_lease(lease)
    except Exception as exc:
        if not is_lease_not_found(exc):
            raise
