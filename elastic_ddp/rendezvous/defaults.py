"""The torchrun settings elastic_ddp ships, in one place.

launch/node.sh, the local cluster (`chaos.cluster`), the benchmarks and docs/configuration.md use
these values; tests/cluster/test_launch.py checks that node.sh carries the same ones. Why these
values (each one watched to work on a loaded 2-core machine): docs/operations.md, "Rendezvous timing".
"""

from __future__ import annotations

# torch's dynamic rendezvous settings: a 1 s last call, heartbeats every second that expire after
# five missed ones (keep_alive_max_attempt=2 stops heartbeats altogether: docs/operations.md).
RDZV_CONF = "join_timeout=300,last_call_timeout=1,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=5"
# Seconds between the agent's checks of its workers.
MONITOR_INTERVAL_S = 0.5
# torch reads this in the agent: "1" gives each worker group a store of its own (the shared store
# makes restarted workers read stale addresses, pytorch/pytorch#135712).
SHARED_STORE_OPT_OUT = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# Environment of every agent: the store fix, and one thread per worker (no oversubscribed cores).
AGENT_ENV = {SHARED_STORE_OPT_OUT: "1", "OMP_NUM_THREADS": "1"}
