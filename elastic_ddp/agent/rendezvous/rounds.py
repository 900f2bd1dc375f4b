"""The rendezvous's rules, as pure functions: when a round may close, and who is in it.

No I/O here; `handler` reads the board and asks these. See `handler` for the
algorithm as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_ddp.agent.rendezvous.defaults import SHIPPED_RDZV_DEFAULTS, conf_switch
from elastic_ddp.agent.rendezvous.liveness import probes_enabled
from elastic_ddp.agent.rendezvous.state import NodeDesc, RoundRecord

# The `--rdzv_conf` key that turns prompt completion off (`prompt_completion=0`). Default on.
PROMPT_COMPLETION_KEY = "prompt_completion"
# The `--rdzv_conf` key that turns in-process rounds off (`in_process=0`: torchrun restarts the
# workers on every change of membership, as before). Default on.
IN_PROCESS_KEY = "in_process"


def prompt_completion_enabled(params: RendezvousParameters) -> bool:
    """`prompt_completion` of `--rdzv_conf` (default on); a bad value raises ValueError naming it."""
    return conf_switch(params, PROMPT_COMPLETION_KEY)


@dataclass(frozen=True)
class RendezvousSettings:
    """The `--rdzv_conf` settings the rendezvous reads (torch's names and meanings)."""

    run_id: str
    min_nodes: int
    max_nodes: int
    # Seconds a node waits in `next_rendezvous` for a round before RendezvousTimeoutError; spares
    # (the redundancy list) wait without a limit, as they wait for a place, not for a round.
    join_timeout: float
    # Once `min_nodes` are in, the round closes when no node arrived for this long.
    last_call_timeout: float
    # A node's keys live on its lease: refreshed every `keep_alive_interval` seconds, it expires
    # after `keep_alive_interval x keep_alive_max_attempt` without a refresh (the node is dead).
    keep_alive_interval: float
    keep_alive_max_attempt: int
    # Close at once when every live member of the last round is in (`prompt_completion=0`: off).
    prompt_completion: bool = True
    # Beacon probes find a killed member before its lease expires (`probe_dead_nodes=0`: off).
    probe_dead_nodes: bool = True
    # After a lost node, the survivors' workers re-form their group in process (`handler`,
    # "In-process rounds"; `in_process=0`: off).
    in_process: bool = True

    @property
    def lease_ttl(self) -> int:
        return max(2, round(self.keep_alive_interval * self.keep_alive_max_attempt))

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> RendezvousSettings:
        """Settings from torchrun's parameters, with `SHIPPED_RDZV_DEFAULTS` for keys left out.
        Raises ValueError naming the `--rdzv_conf` key for a bad value."""
        def number(key: str, kind: type = float) -> float:
            value = params.get(key)
            value = SHIPPED_RDZV_DEFAULTS[key] if value in (None, "") else value
            try:
                parsed = kind(value)
            except (TypeError, ValueError):
                parsed = None
            if parsed is None or parsed <= 0:
                raise ValueError(f"--rdzv_conf {key}: got {value!r}; expected a positive "
                                 f"{'whole number' if kind is int else 'number of seconds'}")
            return parsed

        if params.min_nodes < 1 or params.max_nodes < params.min_nodes:
            raise ValueError(f"--nnodes: got {params.min_nodes}:{params.max_nodes}; expected MIN:MAX with "
                             "1 <= MIN <= MAX")
        return cls(run_id=params.run_id, min_nodes=params.min_nodes, max_nodes=params.max_nodes,
                   join_timeout=number("join_timeout"), last_call_timeout=number("last_call_timeout"),
                   keep_alive_interval=number("keep_alive_interval"),
                   keep_alive_max_attempt=int(number("keep_alive_max_attempt", int)),
                   prompt_completion=prompt_completion_enabled(params), probe_dead_nodes=probes_enabled(params),
                   in_process=conf_switch(params, IN_PROCESS_KEY))


def may_close(arrivals: list[NodeDesc], previous: RoundRecord | None, alive: set[NodeDesc],
              settings: RendezvousSettings, quiet_for: float) -> bool:
    """Whether the round that `arrivals` (in arrival order) wait for may close now.

    Never while fewer than `min_nodes` arrived, nor while a member of the `previous` round is
    `alive` but has not arrived: it is still training in that round, and a round without it would
    be a second world (split brain). Otherwise at once with `max_nodes` in; at once, with prompt
    completion, when there was a previous round (everyone known to be coming is in); else when no
    node arrived for `last_call_timeout` (`quiet_for` seconds since the last arrival seen).
    """
    if len(arrivals) < settings.min_nodes:
        return False
    if previous is not None:
        arrived = set(arrivals)
        if any(member in alive and member not in arrived for member in previous.members):
            return False
    if len(arrivals) >= settings.max_nodes:
        return True
    if previous is not None and settings.prompt_completion:
        return True
    return quiet_for >= settings.last_call_timeout


def closed_round(number: int, arrivals: list[NodeDesc], previous: RoundRecord | None,
                 max_nodes: int) -> RoundRecord:
    """Round `number` made of `arrivals` (in arrival order): the previous round's members that
    arrived first (they keep their places), then the others in arrival order, up to `max_nodes`;
    the rest are spares. Members are ranked in torch's order (sorted node names), so ranks do not
    depend on who arrived first."""
    before = set(previous.members) if previous is not None else set()
    ordered = [n for n in arrivals if n in before] + [n for n in arrivals if n not in before]
    return RoundRecord(number, tuple(sorted(ordered[:max_nodes])), tuple(ordered[max_nodes:]))


def waiting_count(waiting: list[NodeDesc], current: RoundRecord, max_nodes: int) -> int:
    """`num_nodes_waiting` for a member of `current`, given the nodes that arrived at the next
    round: all of them, unless the round is full and only spares wait (the redundancy list does
    not restart a full world; a member among them does: its workers stopped)."""
    if not waiting:
        return 0
    members = set(current.members)
    if len(current.members) < max_nodes or any(node in members for node in waiting):
        return len(waiting)
    return 0
