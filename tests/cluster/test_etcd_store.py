"""EtcdV3Store against a real etcd: every operation, directly and through torch's PrefixStore."""

from __future__ import annotations

import multiprocessing
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.utils.store import barrier

from elastic_ddp.rendezvous import EtcdConnection, EtcdV3Options, EtcdV3Store

if TYPE_CHECKING:
    from tests.support.etcd import EtcdServer

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


def make_store(endpoint: str, run_id: str, timeout_s: float = 5.0, **conf: Any) -> EtcdV3Store:
    params = RendezvousParameters("etcd-v3", endpoint, run_id, 1, 1, **conf)
    return EtcdV3Store(EtcdConnection(EtcdV3Options.from_params(params)), run_id, timedelta(seconds=timeout_s))


@pytest.fixture
def store(shared_etcd_server: EtcdServer, run_id: str) -> EtcdV3Store:
    return make_store(shared_etcd_server.endpoint, run_id)


def test_set_then_get_returns_bytes(store: EtcdV3Store) -> None:
    store.set("text", "hello")
    store.set("raw", b"\x00\xff")
    assert store.get("text") == b"hello"
    assert store.get("raw") == b"\x00\xff"
    store.set("text", "again")
    assert store.get("text") == b"again"


def test_get_waits_for_a_key_set_later(store: EtcdV3Store) -> None:
    setter = threading.Timer(0.5, store.set, args=("late", "here"))
    setter.start()
    started = time.monotonic()
    assert store.get("late") == b"here"
    assert time.monotonic() - started >= 0.4
    setter.join()


def test_get_of_a_missing_key_times_out_with_dist_store_error(store: EtcdV3Store) -> None:
    store.set_timeout(timedelta(seconds=0.5))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="missing"):
        store.get("missing")
    assert 0.5 <= time.monotonic() - started < 3


def test_wait_returns_when_all_keys_exist(store: EtcdV3Store) -> None:
    store.set("a", "1")
    threading.Timer(0.3, store.set, args=("b", "2")).start()
    store.wait(["a", "b"])
    store.wait(["a", "b"], timedelta(seconds=1))


def test_wait_times_out_after_its_own_timeout(store: EtcdV3Store) -> None:
    store.set("a", "1")
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"\['b'\]"):
        store.wait(["a", "b"], timedelta(seconds=0.5))
    assert 0.5 <= time.monotonic() - started < 3


def test_check_reports_presence_without_waiting(store: EtcdV3Store) -> None:
    store.set("a", "1")
    assert store.check(["a"])
    started = time.monotonic()
    assert not store.check(["a", "b"])
    assert time.monotonic() - started < 1


def test_add_counts_from_zero_and_returns_the_new_value(store: EtcdV3Store) -> None:
    assert store.add("counter", 1) == 1
    assert store.add("counter", 5) == 6
    assert store.add("counter", -2) == 4
    assert store.get("counter") == b"4"


def test_an_add_whose_answer_was_lost_is_not_applied_twice(store: EtcdV3Store, monkeypatch) -> None:
    # What a leader dying right after the commit looks like from here: the write landed, and the
    # connection's retry of the same transaction then fails its revision check.
    write = store._write_if_unchanged
    answers_lost = [True]

    def write_and_lose_the_answer(*args, **kwargs):
        landed = write(*args, **kwargs)
        if answers_lost.pop() if answers_lost else False:
            return write(*args, **kwargs)  # the retry: same revision, so it fails
        return landed

    store.add("counter", 3)
    monkeypatch.setattr(store, "_write_if_unchanged", write_and_lose_the_answer)
    assert store.add("counter", 2) == 5
    assert store.get("counter") == b"5"
    assert store.add("counter", 1) == 6  # later adds go on normally
    assert store.num_keys() == 1, "the add marks must not count as store keys"


def test_compare_set_follows_tcpstore_rules(store: EtcdV3Store) -> None:
    assert store.compare_set("k", "", "first") == b"first"  # missing, expected empty: set
    assert store.compare_set("k", "wrong", "second") == b"first"  # mismatch: current value
    assert store.compare_set("k", "first", "second") == b"second"  # match: set
    assert store.compare_set("absent", "x", "y") == b"x"  # missing, expected not empty: no write
    assert not store.check(["absent"])


def test_multi_set_and_multi_get(store: EtcdV3Store) -> None:
    store.multi_set(["a", "b"], ["1", b"2"])
    assert store.multi_get(["b", "a"]) == [b"2", b"1"]
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        store.multi_set(["a", "b"], ["1"])


def test_delete_key_and_num_keys(store: EtcdV3Store) -> None:
    assert store.num_keys() == 0
    store.multi_set(["a", "b"], ["1", "2"])
    assert store.num_keys() == 2
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.num_keys() == 1


def test_keys_are_namespaced_per_run_id(shared_etcd_server: EtcdServer, run_id: str) -> None:
    first = make_store(shared_etcd_server.endpoint, f"{run_id}-first", timeout_s=0.3)
    second = make_store(shared_etcd_server.endpoint, f"{run_id}-second", timeout_s=0.3)
    first.set("shared-name", "first")
    assert not second.check(["shared-name"])
    assert second.num_keys() == 0
    second.set("shared-name", "second")
    assert first.get("shared-name") == b"first"
    listed = shared_etcd_server.etcdctl("get", "--prefix", "--keys-only", first.prefix).stdout.split()
    assert listed == [first.prefix + "shared-name"]


def test_every_operation_through_torch_prefix_store(store: EtcdV3Store) -> None:
    prefixed = dist.PrefixStore("torch.rendezvous.run.0", store)
    prefixed.set("a", "1")
    assert prefixed.get("a") == b"1"
    assert prefixed.add("n", 2) == 2
    assert prefixed.compare_set("a", "1", "2") == b"2"
    prefixed.wait(["a", "n"])
    prefixed.wait(["a"], timedelta(seconds=1))
    assert prefixed.check(["a"])
    prefixed.multi_set(["x", "y"], ["3", "4"])
    assert prefixed.multi_get(["x", "y"]) == [b"3", b"4"]
    prefixed.append("x", "5")
    assert prefixed.get("x") == b"35"
    assert prefixed.num_keys() == 4
    assert prefixed.delete_key("a")
    assert store.get("torch.rendezvous.run.0/n") == b"2"
    prefixed.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError):
        prefixed.get("never")


def test_torch_barrier_and_store_info_work_on_it(shared_etcd_server: EtcdServer, run_id: str) -> None:
    """What the agents do with the store: publish MASTER_ADDR/PORT, then an exit barrier."""
    stores = [make_store(shared_etcd_server.endpoint, run_id) for _ in range(3)]
    results: dict[int, Any] = {}

    def agent(rank: int) -> None:
        info = RendezvousStoreInfo.build(rank, stores[rank], local_addr=f"node{rank}")
        barrier(stores[rank], world_size=3, key_prefix="exit", barrier_timeout=10)
        results[rank] = (info.master_addr, info.master_port)

    threads = [threading.Thread(target=agent, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(set(results.values())) == 1 and len(results) == 3
    assert results[0][0] == "node0"


def _add_many(endpoint: str, run_id: str, times: int, start_together: Any, queue: Any) -> None:
    store = make_store(endpoint, run_id)
    store.check(["warm-up"])  # connected before the race starts
    start_together.wait(timeout=60)
    queue.put([store.add("ticket", 1) for _ in range(times)])


@pytest.mark.timeout(120)
def test_concurrent_add_from_processes_gives_distinct_results(shared_etcd_server: EtcdServer, run_id: str) -> None:
    processes, times = 3, 30
    context = multiprocessing.get_context("spawn")  # gRPC does not survive fork
    queue, start_together = context.Queue(), context.Barrier(processes)
    workers = [context.Process(target=_add_many,
                               args=(shared_etcd_server.endpoint, run_id, times, start_together, queue))
               for _ in range(processes)]
    for worker in workers:
        worker.start()
    tickets = [ticket for _ in workers for ticket in queue.get(timeout=90)]
    for worker in workers:
        worker.join(timeout=30)
        assert worker.exitcode == 0
    assert sorted(tickets) == list(range(1, processes * times + 1))
    assert make_store(shared_etcd_server.endpoint, run_id).get("ticket") == str(processes * times).encode()
