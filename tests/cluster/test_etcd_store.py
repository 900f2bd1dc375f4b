"""EtcdV3Store against a real etcd: the whole torch.distributed.Store contract, directly and
through torch's C++ code (PrefixStore, the pybind trampoline, C++ calling clone())."""

from __future__ import annotations

import gc
import multiprocessing
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import pytest
import torch.distributed as dist
from torch._C._distributed_c10d import _test_python_store
from torch.distributed.distributed_c10d import STORE_BASED_BARRIER_PREFIX, _store_based_barrier
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.utils.store import barrier

from elastic_ddp.agent.rendezvous import EtcdConnection, EtcdV3Options, EtcdV3Store

if TYPE_CHECKING:
    from elastic_ddp.testbed.etcd_server import EtcdServer

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
    try:
        assert store.get("late") == b"here"
        assert time.monotonic() - started >= 0.4
    finally:
        setter.cancel()
        setter.join()


def test_get_of_a_missing_key_times_out_with_dist_store_error(store: EtcdV3Store) -> None:
    store.set_timeout(timedelta(seconds=0.5))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError) as raised:
        store.get("missing")
    assert 0.5 <= time.monotonic() - started < 3
    message = str(raised.value)
    # torch's stores say "timeout" (its tests match "[t -i]imeout"); ours also names keys and prefix.
    assert "timeout" in message and "\n" not in message
    assert "['missing']" in message and store.prefix in message


def test_multi_get_timeout_names_only_the_missing_keys(store: EtcdV3Store) -> None:
    store.set("here", "1")
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(dist.DistStoreError, match=r"multi_get timeout .*\['gone'\]") as raised:
        store.multi_get(["here", "gone"])
    assert "'here'" not in str(raised.value)


def test_a_zero_timeout_waits_without_limit_as_in_c10d(store: EtcdV3Store) -> None:
    # c10d's kNoTimeout: HashStore and FileStore wait forever when the timeout is zero.
    store.set_timeout(timedelta(0))
    setter = threading.Timer(1.0, store.set, args=("late", "here"))
    setter.start()
    started = time.monotonic()
    try:
        assert store.get("late") == b"here"
        assert time.monotonic() - started >= 0.9
    finally:
        setter.cancel()
        setter.join()


def test_wait_returns_only_once_every_key_exists(store: EtcdV3Store) -> None:
    store.set("a", "1")
    waiter_store, returned = store.clone(), threading.Event()
    outcome: dict[str, Any] = {}

    def wait_for_a_and_b() -> None:
        try:
            waiter_store.wait(["a", "b"])  # the store's own timeout: 5 s
            outcome["returned_at"] = time.monotonic()
            outcome["present"] = waiter_store.check(["a", "b"])  # check() does not wait
            outcome["b"] = waiter_store.get("b") if outcome["present"] else None
        except Exception as exc:  # noqa: BLE001 - reported by the test below
            outcome["error"] = exc
        finally:
            returned.set()

    waiter = threading.Thread(target=wait_for_a_and_b)
    waiter.start()
    try:
        assert not returned.wait(timeout=0.5), f"wait() returned while 'b' was missing: {outcome}"
        set_at = time.monotonic()
        store.set("b", "2")
        assert returned.wait(timeout=10), "wait() did not return once 'b' was set"
    finally:
        waiter.join(timeout=10)  # wait() gives up after the store's 5 s timeout at the latest
    assert not waiter.is_alive()
    assert "error" not in outcome, outcome
    assert outcome["returned_at"] >= set_at and outcome["present"] and outcome["b"] == b"2"
    store.wait(["a", "b"], timedelta(seconds=1))  # both there: returns, where a timeout would raise


def test_wait_times_out_after_its_own_timeout(store: EtcdV3Store) -> None:
    store.set("a", "1")
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"wait timeout .*\['b'\]"):
        store.wait(["a", "b"], timedelta(seconds=0.5))
    assert 0.5 <= time.monotonic() - started < 3  # not the store's 5 s


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
    assert type(store.add("counter", 0)) is int


def test_append_creates_a_missing_key_then_extends_it(store: EtcdV3Store) -> None:
    store.append("log", "po")
    store.append("log", b"ta\x00to")
    assert store.get("log") == b"pota\x00to"
    store.set("other", "x")
    store.append("other", "y")
    assert store.get("other") == b"xy"


def test_concurrent_appends_keep_every_chunk_once(store: EtcdV3Store) -> None:
    chunks = [f"<{worker}.{i}>" for worker in range(3) for i in range(8)]

    def append_mine(worker: int) -> None:
        mine = store.clone()  # one store per thread, as c10d's clone() is meant for
        for chunk in chunks[worker * 8:(worker + 1) * 8]:
            mine.append("log", chunk)

    threads = [threading.Thread(target=append_mine, args=(worker,)) for worker in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    value = store.get("log").decode()
    assert len(value) == sum(len(chunk) for chunk in chunks)
    assert all(value.count(chunk) == 1 for chunk in chunks)


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


def test_an_append_whose_answer_was_lost_is_not_applied_twice(store: EtcdV3Store, monkeypatch) -> None:
    write = store._write_if_unchanged
    answers_lost = [True]

    def write_and_lose_the_first_answer(*args, **kwargs):
        landed = write(*args, **kwargs)
        if answers_lost and answers_lost.pop():
            return write(*args, **kwargs)  # the connection's retry: same revision, so it fails
        return landed

    store.append("log", "a")
    monkeypatch.setattr(store, "_write_if_unchanged", write_and_lose_the_first_answer)
    store.append("log", "b")
    assert store.get("log") == b"ab"
    store.append("log", "c")
    assert store.get("log") == b"abc"


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
    assert not store.check(["a"])


def test_list_keys_lists_plain_keys_only(store: EtcdV3Store) -> None:
    store.multi_set(["b", "a/x"], ["1", "2"])
    store.add("n", 1)  # writes an operation mark too
    store.queue_push("q", "item")
    assert store.list_keys() == ["a/x", "b", "n"]
    assert store.num_keys() == 3


def test_clone_sees_the_same_keys_and_starts_with_the_same_timeout(store: EtcdV3Store) -> None:
    twin = store.clone()
    assert isinstance(twin, EtcdV3Store) and twin is not store
    assert twin.prefix == store.prefix and twin.timeout == store.timeout
    store.set("from-original", "1")
    twin.set("from-clone", "2")
    assert twin.get("from-original") == b"1" and store.get("from-clone") == b"2"
    twin.set_timeout(timedelta(seconds=0.2))
    assert store.timeout == timedelta(seconds=5), "a clone's timeout is its own"


def test_has_extended_api_is_true_in_python_and_in_cpp(store: EtcdV3Store) -> None:
    assert store.has_extended_api()
    # PrefixStore asks the trampoline (PythonStore::hasExtendedApi), which must find our override.
    assert dist.PrefixStore("p", store).has_extended_api()


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


class _CountingStore(EtcdV3Store):
    """Counts which Python methods torch's C++ code reaches."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: Counter[str] = Counter()

    def clone(self) -> EtcdV3Store:
        self.calls["clone"] += 1
        return super().clone()

    def append(self, key: str, value: str | bytes) -> None:
        self.calls["append"] += 1
        super().append(key, value)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        self.calls["compare_set"] += 1
        return super().compare_set(key, expected_value, desired_value)


@pytest.fixture
def counting_store(shared_etcd_server: EtcdServer, run_id: str) -> _CountingStore:
    params = RendezvousParameters("etcd-v3", shared_etcd_server.endpoint, run_id, 1, 1)
    return _CountingStore(EtcdConnection(EtcdV3Options.from_params(params)), run_id, timedelta(seconds=5))


def test_torchs_cpp_store_self_test_passes_and_calls_clone(counting_store: _CountingStore) -> None:
    _test_python_store(counting_store)  # torch's C++ checks of the trampoline; raises on a mismatch
    assert counting_store.calls["clone"] == 1
    assert counting_store.get("key") == b"6" and counting_store.get("key0") == b"value0"
    assert counting_store.get("foo") == b"bar"  # written through the clone C++ made


def test_a_clone_made_by_cpp_keeps_its_python_half(counting_store: _CountingStore) -> None:
    prefixed = dist.PrefixStore("pre", counting_store).clone()  # C++ calls our clone()
    gc.collect()  # nothing in Python refers to the EtcdV3Store clone any more
    assert counting_store.calls["clone"] == 1
    assert type(prefixed.underlying_store) is EtcdV3Store
    prefixed.set("k", "v")
    assert counting_store.get("pre/k") == b"v"


def test_cpp_append_uses_the_native_append_not_compare_set(counting_store: _CountingStore) -> None:
    prefixed = dist.PrefixStore("pre", counting_store)
    prefixed.append("log", "po")
    prefixed.append("log", "tato")
    assert counting_store.get("pre/log") == b"potato"
    assert counting_store.calls == Counter(append=2)


def test_values_with_nul_bytes_and_int_results_cross_cpp_intact(store: EtcdV3Store) -> None:
    prefixed = dist.PrefixStore("pre", store)
    raw = b"\x00a\x00\xff"
    prefixed.set("raw", raw)
    assert store.get("pre/raw") == raw and prefixed.get("raw") == raw
    prefixed.multi_set(["x", "y"], [raw, b""])
    assert prefixed.multi_get(["x", "y"]) == [raw, b""]
    assert prefixed.compare_set("raw", raw, b"\x00") == b"\x00"
    result = prefixed.add("n", -3)
    assert result == -3 and type(result) is int


def test_cpp_wait_takes_its_own_timeout_and_raises_dist_store_error(store: EtcdV3Store) -> None:
    prefixed = dist.PrefixStore("pre", store)
    store.set_timeout(timedelta(seconds=30))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"wait timeout .*\['pre/never'\]"):
        prefixed.wait(["never"], timedelta(seconds=0.3))
    assert time.monotonic() - started < 3


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


def test_store_based_barrier_over_prefix_stores_of_clones(store: EtcdV3Store) -> None:
    """What init_process_group does with a store: c10d's barrier, through a PrefixStore per rank."""
    world, done = 3, []

    def rank(number: int) -> None:
        prefixed = dist.PrefixStore("default_pg", store.clone())
        _store_based_barrier(number, prefixed, "group", world, timedelta(seconds=20))
        done.append(number)

    threads = [threading.Thread(target=rank, args=(number,)) for number in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(done) == [0, 1, 2]
    assert store.get(f"default_pg/{STORE_BASED_BARRIER_PREFIX}:group") == b"3"


def test_cpp_store_barrier_releases_all_and_times_out_alone(store: EtcdV3Store) -> None:
    clones, released = [store.clone() for _ in range(2)], []

    def member(index: int) -> None:
        clones[index].barrier("together", 2, timedelta(seconds=20))
        released.append(index)

    threads = [threading.Thread(target=member, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(released) == [0, 1]
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.barrier("alone", 2, timedelta(seconds=0.3))


def test_queue_is_first_in_first_out_and_counts_as_a_key(store: EtcdV3Store) -> None:
    assert store.queue_len("jobs") == 0 and not store.check(["jobs"])
    for item in ["1", b"2\x00", "3"]:
        store.queue_push("jobs", item)
    assert store.queue_len("jobs") == 3 and store.check(["jobs"])
    store.wait(["jobs"], timedelta(seconds=1))
    assert [store.queue_pop("jobs") for _ in range(3)] == [b"1", b"2\x00", b"3"]
    assert store.queue_len("jobs") == 0 and not store.check(["jobs"])
    assert store.num_keys() == 0, "queues are not plain keys"


def test_queue_names_do_not_nest(store: EtcdV3Store) -> None:
    store.queue_push("a/b", "inner")
    assert store.queue_len("a") == 0
    with pytest.raises(dist.QueueEmptyError):
        store.queue_pop("a", block=False)
    assert store.queue_pop("a/b", block=False) == b"inner"


def test_queue_pop_empty_nonblocking_and_blocking_timeout(store: EtcdV3Store) -> None:
    with pytest.raises(dist.QueueEmptyError, match="empty"):
        store.queue_pop("none", block=False)
    store.set_timeout(timedelta(seconds=0.3))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=r"queue_pop timeout .*'none'"):
        store.queue_pop("none")
    assert 0.3 <= time.monotonic() - started < 3


def test_blocking_queue_pop_gets_an_item_pushed_later(store: EtcdV3Store) -> None:
    pusher = threading.Timer(0.5, store.clone().queue_push, args=("later", "x"))
    pusher.start()
    started = time.monotonic()
    try:
        assert store.queue_pop("later") == b"x"
        assert time.monotonic() - started >= 0.4
    finally:
        pusher.cancel()
        pusher.join()


def test_concurrent_consumers_each_get_distinct_items(store: EtcdV3Store) -> None:
    items = [f"item{i}" for i in range(24)]
    for item in items:
        store.queue_push("work", item)
    taken: list[bytes] = []

    def consume() -> None:
        mine = store.clone()
        while True:
            try:
                taken.append(mine.queue_pop("work", block=False))
            except dist.QueueEmptyError:
                return

    threads = [threading.Thread(target=consume) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(taken) == sorted(item.encode() for item in items)


def test_queues_do_not_reach_python_through_cpp(store: EtcdV3Store) -> None:
    """torch 2.13's trampoline does not forward queue calls: the documented limit, pinned."""
    with pytest.raises(NotImplementedError):
        dist.PrefixStore("pre", store).queue_push("q", "1")
    assert store.queue_len("pre/q") == 0


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
