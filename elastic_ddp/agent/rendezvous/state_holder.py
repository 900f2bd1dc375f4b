"""How our backends' agents see torch's rendezvous state: dead nodes dropped, rounds completed promptly,
a last call that waits for nodes still arriving.

torch's dynamic rendezvous keeps its state (round, participants, wait list, heartbeats) in the
backend, and every agent reads and writes it through a state holder, whose `_sanitize` drops the
nodes whose heartbeat expired. `ElasticStateHolder` is torch's holder with three additions, all
made while this agent waits in the rendezvous; the first two only ever earlier versions of what
torch would do anyway:

- **Dead-node probes** (`liveness`): a node whose agent has provably exited is dropped at once,
  not when its heartbeat expires (`probe_dead_nodes=0` in `--rdzv_conf` turns them off).
- **Prompt completion**: torch completes a round `last_call_timeout` after it reached its minimum
  size, in case more nodes come. After a failure or a join the nodes to expect are known: the
  participants of the round before, less the ones that left (exited, or heartbeat expired), plus
  the nodes that asked to join. Once all of them are in the new round and nobody waits, the round
  completes at once. Otherwise (the first round, a node that has not come back yet, one more
  arriving) the last call applies (`prompt_completion=0` turns this off).
- **A last call that waits for arrivals**: torch's last call runs from the moment the round
  reached `min_nodes`; a node that joins during it restarts it here (its joining write carries a
  deadline one `last_call_timeout` after its arrival). A round so completes once no node has
  arrived for a last call, instead of after a fixed second in which many nodes cannot all write
  the state (63 agents re-entering after a kill): part of them formed a round and the others
  restarted it (docs/benchmarks-history.md, "Rendezvous at scale"). Bounded: a round completes at
  `max_nodes`, so at most `max_nodes` arrivals each restart it (`extend_last_call=0` turns this
  off).

With a heartbeat channel (`heartbeats`; etcd-v3 has one), a heartbeat that is the only change this
agent made to the state it read is published there, with a plain write, instead of by a
compare-and-set of the whole state; and the peers' published beats are merged into every state
read before torch's `_sanitize` looks for expired nodes. The channel is read only when a peer's
heartbeat looks overdue (`OVERDUE_HEARTBEATS` intervals), at most every half interval: while all
is well, about once per overdue period. Any sync also beats on the channel once this node's last
beat is an interval old, since torch sends none while an agent leaves a round.

It also reads the state more often: the state it has read is reused for `SYNC_POLL_S` (torch: 1 s),
which is how often a waiting agent looks again (`torch_internals.poll_rendezvous_every`); with
`nodes_per_poll` (etcd-v3: 16) that grows with the nodes in the state, since every agent reads it
that often, while training too (torchrun's monitor loop asks for the waiting nodes ten times a
second): 64 agents reading a 4 KB state through etcd ten times a second each kept the 2-core
machine of the benchmark saturated.

Limits: the dead-node probes' (see `liveness`). A node that comes back within its heartbeat expiry
after having left is not expected, nor is one found exited, until its name answers again (an agent
restarted with the same identity, as a container restarted in place is: see `liveness`).
A node that joins a moment after a prompt completion makes one more round (as after a last call).
"""

from __future__ import annotations

import logging
import math
import random
import time
from datetime import datetime, timedelta, timezone

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elastic_ddp.agent.rendezvous import torch_internals
from elastic_ddp.agent.rendezvous.defaults import SYNC_POLL_S, conf_switch
from elastic_ddp.agent.rendezvous.heartbeats import HeartbeatChannel
from elastic_ddp.agent.rendezvous.liveness import Beacon, DeadNodeDetector
from elastic_ddp.agent.rendezvous.torch_internals import BackendStateHolder, NodeDesc

logger = logging.getLogger(__name__)

# The `--rdzv_conf` keys that turn prompt completion and the arrival-restarted last call off
# (`prompt_completion=0`, `extend_last_call=0`). Default on.
PROMPT_COMPLETION_KEY = "prompt_completion"
EXTEND_LAST_CALL_KEY = "extend_last_call"
# The random wait after a lost compare-and-set of the state: up to this per node in the state,
# and never more than MAX_BACKOFF_S (a state write takes about a millisecond on loopback).
LOST_WRITE_BACKOFF_S = 0.002
MAX_BACKOFF_S = 0.1
# A peer whose newest heartbeat is older than this many keep-alive intervals is probed (a live
# agent beats once per interval; the half interval absorbs a late one).
OVERDUE_HEARTBEATS = 1.5
# The heartbeat channel is read at most once per this many keep-alive intervals.
CHANNEL_READ_INTERVALS = 0.5


def _structure(state) -> tuple:
    """Everything of torch's rendezvous state except the heartbeat times: which nodes have one
    is part of it (a node that leaves deletes its heartbeat)."""
    return (state.round, state.complete, state.deadline, state.closed, dict(state.participants),
            frozenset(state.wait_list), frozenset(state.redundancy_list), frozenset(state.last_heartbeats))


class ElasticStateHolder(BackendStateHolder):
    """torch's state holder with dead-node probes, prompt completion and a last call that waits
    for arrivals (see the module docstring).

    `detector` and `beacon` are None when the probes are off; `heartbeats` is None where the
    backend has no heartbeat channel (heartbeats then go through the state, as in torch). With
    `nodes_per_poll`, a state read is reused for `SYNC_POLL_S` per that many nodes in it (never
    less than `SYNC_POLL_S`), for backends whose reads are dear; 0 keeps `SYNC_POLL_S`.
    """

    def __init__(self, backend: RendezvousBackend, settings, node: NodeDesc,
                 detector: DeadNodeDetector | None, beacon: Beacon | None, prompt_completion: bool = True,
                 extend_last_call: bool = True, heartbeats: HeartbeatChannel | None = None,
                 nodes_per_poll: int = 0) -> None:
        super().__init__(backend, settings, cache_duration=SYNC_POLL_S)
        self._node = node
        self._detector = detector
        self._beacon = beacon  # held here so that it lives as long as the handler
        self._prompt_completion = prompt_completion
        self._extend_last_call = extend_last_call
        self._previous_round: tuple[int, frozenset[NodeDesc]] | None = None  # the newest complete round seen
        self._heartbeats: dict[NodeDesc, datetime] = {}  # the newest heartbeat seen of each node
        self._channel = heartbeats
        self._nodes_per_poll = nodes_per_poll
        self._read_structure: tuple | None = None  # `_structure` of the state as last read
        self._published: datetime | None = None  # this node's newest beat on the channel
        self._channel_beats: dict[NodeDesc, datetime] = {}  # the channel as last read
        self._channel_read_at = -math.inf  # time.monotonic() of that read

    def _sanitize(self) -> None:
        """See base class. Before it, merge the heartbeat channel's beats. Afterwards, while this
        node waits, drop the peers that have exited and complete the round if every node to
        expect is in."""
        state = self._state
        if self._channel is not None:
            self._read_structure = _structure(state)
            self._merge_published_beats()
        super()._sanitize()
        for node, beat in state.last_heartbeats.items():
            if node not in self._heartbeats or beat > self._heartbeats[node]:
                self._heartbeats[node] = beat
        if state.complete:
            self._remember_members(state.round, state.participants.keys())
        others = [node for node in (*state.participants, *state.wait_list, *state.redundancy_list)
                  if node != self._node]
        if state.complete and self._node in state.participants:
            if self._detector is not None:
                # Where each peer's beacon is, learnt while all is well: not while a round forms,
                # where these reads and probes would slow every agent's turn at the state.
                self._detector.observe(others)
            return  # training: nothing waits
        if self._detector is not None:
            self._drop_exited_peers(others, self._suspects(others))
        if self._extend_last_call:
            self._restart_last_call_on_arrival()
        if self._prompt_completion:
            self._complete_promptly()

    def _remember_members(self, round_: int, participants) -> None:
        """Every participant of complete round `round_` seen so far: its participants leave one by
        one when it ends (each agent removes itself before it rejoins), so keep the union."""
        if self._previous_round is None or self._previous_round[0] != round_:
            self._previous_round = (round_, frozenset(participants))
        else:
            self._previous_round = (round_, self._previous_round[1] | frozenset(participants))

    def sync(self) -> bool | None:
        """See base class. A heartbeat that is the only change to the state as read goes to the
        heartbeat channel, if there is one (True: published). After a lost compare-and-set, wait a
        random moment before the caller tries again (`LOST_WRITE_BACKOFF_S` per node in the state,
        at most `MAX_BACKOFF_S`): N agents that all retry at once make each success cost N
        attempts."""
        if self._dirty and self._channel is not None and self._only_heartbeat_changed():
            beat = self._state.last_heartbeats[self._node]
            self._channel.publish(self._node, beat)
            self._published = beat
            self._dirty = False
            return True
        has_set = super().sync()
        if self._channel is not None:
            self._beat_while_busy()
        if self._nodes_per_poll:
            self._cache_duration = SYNC_POLL_S * max(1.0, self._node_count() / self._nodes_per_poll)
        if has_set is False:
            time.sleep(random.uniform(0, min(MAX_BACKOFF_S, LOST_WRITE_BACKOFF_S * max(1, self._node_count()))))
        return has_set

    def _beat_while_busy(self) -> None:
        """Publish a fresh heartbeat on the channel if this node's last one is an interval old.
        torch beats only from its heartbeat thread, which it stops while the agent is in
        `next_rendezvous`, and from its join; leaving a complete round sends none, and 63 agents
        that all leave at once need seconds of lost compare-and-sets to get their turn, long
        enough for their heartbeats to expire while they wait. On the channel this costs nothing
        to anyone else. Only for a node that has a heartbeat in the state (one that left has none)."""
        beats = self._state.last_heartbeats  # this node's already raised to its newest published one
        now = datetime.now(timezone.utc)
        if self._node in beats and now - beats[self._node] >= self._settings.keep_alive_interval:
            self._channel.publish(self._node, now)
            self._published = beats[self._node] = now

    def _node_count(self) -> int:
        """The nodes in the state: participants, waiting and redundant."""
        state = self._state
        return len(state.participants) + len(state.wait_list) + len(state.redundancy_list)

    def _only_heartbeat_changed(self) -> bool:
        """Whether this node's own heartbeat time is all it changed in the state since the read."""
        beat = self._state.last_heartbeats.get(self._node)
        return (beat is not None and (self._published is None or beat > self._published)
                and self._read_structure is not None and _structure(self._state) == self._read_structure)

    def _merge_published_beats(self) -> None:
        """Raise the heartbeats in the state just read to the newest published ones: this node's
        own, and the peers' from the channel, read again if a peer looks overdue and the last read
        is half an interval old. Only nodes that have a heartbeat in the state get one: a stale
        key never brings back a node that left."""
        beats = self._state.last_heartbeats
        interval = self._settings.keep_alive_interval
        if self._published is not None and self._node in beats:
            beats[self._node] = max(beats[self._node], self._published)
        now = datetime.now(timezone.utc)
        overdue = any(now - max(beat, self._channel_beats.get(node, beat)) > interval * OVERDUE_HEARTBEATS
                      for node, beat in beats.items() if node != self._node)
        if overdue and time.monotonic() - self._channel_read_at >= interval.total_seconds() * CHANNEL_READ_INTERVALS:
            self._channel_beats = self._channel.read()
            self._channel_read_at = time.monotonic()
        for node, beat in self._channel_beats.items():
            if node in beats and node != self._node and beat > beats[node]:
                beats[node] = beat

    def _suspects(self, others: list[NodeDesc]) -> list[NodeDesc]:
        """The peers worth probing at this sync (see `liveness`): participants of a complete round
        (this node has left it: they must leave too, or be found dead, before the next round), and
        peers whose heartbeat is overdue. A live peer that has joined the forming round is neither."""
        state = self._state
        now = datetime.now(timezone.utc)
        overdue = self._settings.keep_alive_interval * OVERDUE_HEARTBEATS
        return [node for node in others
                if (state.complete and node in state.participants)
                or now - self._heartbeats.get(node, now) > overdue]

    def _drop_exited_peers(self, others: list[NodeDesc], suspects: list[NodeDesc]) -> None:
        state = self._state
        participant_removed = False
        for node in self._detector.dead(others, suspects):
            # A warning: the one line in the agent's log (torchrun shows warnings) that says why the
            # round went on before the dead node's heartbeat expired.
            logger.warning("node %s has exited (its beacon refuses connections): removed from rendezvous '%s' "
                           "without waiting for its heartbeat to expire", node, self._settings.run_id)
            state.last_heartbeats.pop(node, None)
            participant_removed |= state.participants.pop(node, None) is not None
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
        if participant_removed:
            torch_internals.remove_participant_epilogue(state, self._settings)

    def _restart_last_call_on_arrival(self) -> None:
        """This node is about to join a forming round whose last call has begun (torch's join
        adds a node that is neither a participant nor late for a complete round): move the
        deadline to a last call from now. Only this agent's copy changes; its joining write
        publishes it, and a lost write is retried from a fresh read, which comes here again."""
        state = self._state
        if state.complete or state.deadline is None or self._node in state.participants:
            return
        state.deadline = max(state.deadline, datetime.now(timezone.utc) + self._settings.timeout.last_call)

    def _complete_promptly(self) -> None:
        state = self._state
        if (state.complete or self._previous_round is None or state.round != self._previous_round[0] + 1
                or self._node not in state.participants or state.wait_list
                or len(state.participants) < self._settings.min_nodes):
            return
        expected = {node for node in self._previous_round[1] if self._may_come_back(node)}
        if not expected <= state.participants.keys():
            return
        now = datetime.now(timezone.utc)
        if state.deadline is None or state.deadline > now:
            # torch completes the round once its deadline has passed: this brings the deadline in.
            state.deadline = now - timedelta(microseconds=1)
            logger.info("rendezvous '%s': every node of round %d that is still alive is back: completing round %d "
                        "without the last call", self._settings.run_id, state.round - 1, state.round)

    def _may_come_back(self, node: NodeDesc) -> bool:
        """Whether `node` of the previous round may still join: not exited (as the probes know it
        now: a node restarted with the same identity is not), heartbeat not expired."""
        if self._detector is not None and self._detector.has_exited(node):
            return False
        beat = self._heartbeats.get(node)
        expiry = self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt
        return beat is not None and datetime.now(timezone.utc) - beat < expiry


def prompt_completion_enabled(params: RendezvousParameters) -> bool:
    """`prompt_completion` of `--rdzv_conf` (default on); a bad value raises ValueError naming it."""
    return conf_switch(params, PROMPT_COMPLETION_KEY)


def last_call_extension_enabled(params: RendezvousParameters) -> bool:
    """`extend_last_call` of `--rdzv_conf` (default on); a bad value raises ValueError naming it."""
    return conf_switch(params, EXTEND_LAST_CALL_KEY)
