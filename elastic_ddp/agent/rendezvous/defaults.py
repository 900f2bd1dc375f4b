"""The torchrun settings elastic_ddp ships, in one place.

Our backends (`elastic-c10d`, `etcd-v3`) apply `SHIPPED_RDZV_DEFAULTS` themselves to every key the
user's `--rdzv_conf` leaves out; `RDZV_CONF` is the same settings as a `--rdzv_conf` value, for
torch's own `c10d` (launch/node.sh, the local cluster (`chaos.cluster`), the benchmarks and
docs/configuration.md use these values; tests/cluster/test_launch_recipes.py checks that node.sh
carries the same ones). Why these values (each one watched to work on a loaded 2-core machine):
docs/operations.md, "Rendezvous timing".
"""

from __future__ import annotations

# The rendezvous timing our backends read: a 1 s last call, heartbeats (a lease) every second
# that expire after five missed ones (keep_alive_max_attempt=2 stops torch's heartbeats altogether:
# docs/operations.md). torch's own defaults: join 600 s, last call 30 s, heartbeats every 5 s, 3
# missed. Not `close_timeout`: our rendezvous refuses it (it closes in one write), and torch's
# 30 s only bounds the last write of a job that ends.
SHIPPED_RDZV_DEFAULTS: dict[str, int] = {
    "join_timeout": 300, "last_call_timeout": 1, "keep_alive_interval": 1, "keep_alive_max_attempt": 5,
}
RDZV_CONF = ",".join(f"{key}={value}" for key, value in SHIPPED_RDZV_DEFAULTS.items())
# Seconds between the agent's checks of its workers (torchrun's own default since torch 2.3).
MONITOR_INTERVAL_S = 0.1
# Seconds between two looks of a waiting agent at the round, with our backends (torch's `c10d`
# looks once a second).
SYNC_POLL_S = 0.1
# Seconds the survivors' handlers wait for an in-process round (`handler`, "In-process rounds")
# before torchrun restarts their workers instead; and how often they look at the board meanwhile
# (the workers wait, so faster than SYNC_POLL_S).
REFORM_TIMEOUT_S = 10.0
REFORM_POLL_S = 0.02
# torch reads this in the agent: "1" gives each worker group a store of its own (the shared store
# makes restarted workers read stale addresses, pytorch/pytorch#135712).
SHARED_STORE_OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# Environment of every agent: the store fix, and one thread per worker (no oversubscribed cores).
AGENT_ENV = {SHARED_STORE_OPT_OUT: "1", "OMP_NUM_THREADS": "1"}


def conf_switch(params, key: str, default: bool = True) -> bool:
    """An on/off key of our backends' `--rdzv_conf` (`RendezvousParameters`); a bad value raises
    ValueError naming the key, the value and what is accepted."""
    try:
        return bool(params.get_as_bool(key, default))
    except ValueError:
        raise ValueError(f"--rdzv_conf {key}: got {params.get(key)!r}; expected 1 or 0 (also true/false, "
                         "yes/no)") from None
