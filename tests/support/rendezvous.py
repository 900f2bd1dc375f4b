"""Running torch's rendezvous handlers side by side in one process (one thread per "agent")."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore


def each_together(handlers, call, timeout: float, what: str = "a call") -> list:
    """`call(handler)` for every handler at once, each in a thread of its own (each agent's main
    loop); their results (or exception), in order. Fails the test if one has not returned within
    `timeout` seconds."""
    results: list = [None] * len(handlers)

    def run(index):
        try:
            results[index] = call(handlers[index])
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[index] = exc

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in threads), f"{what} did not return"
    return results


def rendezvous_together(handlers, timeout: float = 90) -> list:
    """Every handler's next_rendezvous, run at once; their RendezvousInfo (or exception), in order.
    Fails the test if one has not returned within `timeout` seconds."""
    return each_together(handlers, lambda handler: handler.next_rendezvous(), timeout, "a rendezvous")


def ranks_by_node(handlers, timeout: float = 30) -> dict:
    """`rendezvous_together` for handlers with a `node` (ours): node -> (rank, world size),
    or the exception its next_rendezvous raised."""
    results = rendezvous_together(handlers, timeout)
    return {handler.node: result if isinstance(result, BaseException) else (result.rank, result.world_size)
            for handler, result in zip(handlers, results)}


class Background:
    """`handler.next_rendezvous()` in a thread (torch's tests: `_CapturingThread`); `result()` waits
    for it under a deadline and returns its RendezvousInfo or the exception it raised."""

    def __init__(self, handler) -> None:
        self.outcome: Any = None
        self.thread = threading.Thread(target=self._run, args=(handler,), daemon=True)
        self.thread.start()

    def _run(self, handler) -> None:
        try:
            self.outcome = handler.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            self.outcome = exc

    def result(self, timeout: float = 30) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"next_rendezvous did not return within {timeout} s"
        return self.outcome


def assert_one_world(infos: list, size: int) -> list:
    """`infos` (RendezvousInfo) are one world of `size`: no exception, ranks 0..size-1; returns them."""
    assert all(not isinstance(info, Exception) for info in infos), infos
    assert sorted(info.rank for info in infos) == list(range(size))
    assert {info.world_size for info in infos} == {size}
    return infos


@contextlib.contextmanager
def serving_board(made: list) -> Iterator[TCPStore]:
    """A TCPStore for the elastic-c10d boards of a test's handlers (multi-tenant, as torchrun's
    agent hosts it); on the way out, the handlers in `made` leave and close their beacons first, so
    that their heartbeat threads stop before the store does."""
    store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=timedelta(seconds=20))
    try:
        yield store
    finally:
        while made:
            handler = made.pop()
            handler._board.leave()
            handler._witness.close()
