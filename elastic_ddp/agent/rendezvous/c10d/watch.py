"""A rendezvous store that went silent: this node cut off, or the store's node cut off?

    watch = StoreWatch(host, port, silence_s=5)
    state = watch.call("read the rendezvous state", backend.get_state)

A TCPStore request on a connection whose packets vanish (a partition: no reset, no refusal)
blocks well past the store's timeout, and torchrun's agent makes one ten times a second
(`num_nodes_waiting`), so a node whose c10d store's node was cut off never stops: its agent hangs
in the request. `StoreWatch.call` runs each request of the rendezvous backend on a thread of its
own and waits for it; once one has had no answer for `silence_s` (the heartbeat expiry: by then
the store's side counts this node as gone anyway) it asks whether the network works at all, by
probing the other nodes of the rendezvous (`peers_answer`, their dead-node beacons), then tries the
endpoint itself (`PROBE_TIMEOUT_S`); an endpoint that answers is a slow store, waited for:

- some other node answers, and the endpoint, asked after them, does not: the network works, the
  store's node is what is cut off (asked in that order, so that this node's own partition healing
  between the two questions does not count). The request raises `RendezvousConnectionError`, one line naming the endpoint, and so does every later one
  at once: torchrun's agent stops its workers and exits. Relaunch the job with an endpoint that
  works; it resumes from the newest state any node holds.
- no other node answers (or none is known): this node is the one cut off, as far as it can tell.
  It says so in one warning line and keeps waiting, as torch does, so that it rejoins by itself
  when its link returns.

Bound: a node stops `silence_s + PROBE_TIMEOUT_S` (+ one beacon probe per peer, 0.25 s each at
most) after its first unanswered request, 7 s with the shipped settings; then torchrun stops its
workers (SIGTERM; SIGKILL after its shutdown timeout, 30 s by default, for a worker blocked in a
collective).

Not guaranteed: with `probe_dead_nodes=0` there are no beacons, so no peer is ever known to
answer and a node whose store's node is cut off waits like a cut-off node (torch's behaviour). A
request that the endpoint answers slowly is waited for, however long (torch's read timeout).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elastic_ddp.agent.rendezvous.c10d import store

logger = logging.getLogger(__name__)

T = TypeVar("T")


class StoreWatch:
    """Runs the requests of one rendezvous backend with a bound on the store's silence (module
    docstring). Thread-safe; the requests run one at a time, in order, as a TCPStore client runs them."""

    def __init__(self, host: str, port: int, silence_s: float):
        self.host, self.port, self.silence_s = host, port, silence_s
        # Whether some other node of the rendezvous answers now; set once the beacons exist.
        self.peers_answer: Callable[[], bool] = lambda: False
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._lost: str | None = None
        self._warned = False
        threading.Thread(target=self._serve, name="elastic-ddp-store-requests", daemon=True).start()

    def call(self, what: str, request: Callable[[], T]) -> T:
        """`request()`, run on the watch's thread; RendezvousConnectionError (one line) once the
        store's node is found cut off (module docstring)."""
        if self._lost is not None:
            raise RendezvousConnectionError(self._lost)
        done = threading.Event()
        outcome: list[Any] = []
        self._requests.put((request, outcome, done))
        started = time.monotonic()
        while not done.wait(self.silence_s):
            self._judge(what, time.monotonic() - started)
        if self._warned:
            self._warned = False
            logger.warning("the rendezvous store at --rdzv_endpoint=%s:%d answers again", self.host, self.port)
        value, error = outcome
        if error is not None:
            raise error
        return value

    def _judge(self, what: str, silent_s: float) -> None:
        if self._lost is not None:
            raise RendezvousConnectionError(self._lost)
        # The peers first, then the endpoint: asked the other way round, a partition of this node
        # that heals between the two questions (the endpoint unreachable, then the peers answering)
        # looked like the store's node cut off and stopped a node that was about to rejoin. This
        # way a heal in between makes the endpoint answer, and the node waits on.
        peers_answer = self.peers_answer()
        reason = store.unanswered(self.host, self.port)
        if reason is None:
            return  # the endpoint's machine answers: a slow store, torch's read timeout applies
        if peers_answer:
            self._lost = (f"lost the c10d rendezvous store at --rdzv_endpoint={self.host}:{self.port}: no answer to "
                          f"'{what}' for {silent_s:.0f} s and none to a new connection ({reason}), while other nodes "
                          "answer: the store's node is cut off. This node stops; relaunch the job with a reachable "
                          "--rdzv_endpoint, it resumes from the newest state any node holds")
            logger.error("%s", self._lost)
            raise RendezvousConnectionError(self._lost)
        if not self._warned:
            self._warned = True
            logger.warning("the rendezvous store at --rdzv_endpoint=%s:%d has not answered '%s' for %.0f s (%s), and "
                           "no other node answers either: this node seems cut off; waiting for its network to return",
                           self.host, self.port, what, silent_s, reason)

    def _serve(self) -> None:
        while True:
            request, outcome, done = self._requests.get()
            try:
                outcome[:] = [request(), None]
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
                outcome[:] = [None, exc]
            done.set()
